"""The README's own-model walk-through (``examples/own_model``): a ranker written with TorchRec
alone, which takes exactly one candidate and one user id an item, built from its own checkpoint
through an adapter and a prefix mapping, captured as a graph, and served as the model scores,
one candidate alone included."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from handlers.runtime.artifacts import Artifact
from tests.helpers import QUANTIZATION_TOLERANCE, archive_service

from torchrec import KeyedJaggedTensor  # isort: skip

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_model"


@pytest.fixture(scope="module")
def seq_ranker():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import seq_ranker

        yield seq_ranker
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("seq_ranker", None)


@pytest.fixture(scope="module")
def trained(seq_ranker, tmp_path_factory):
    """The model as its team saved it: SeqRanker's own state names, no prefix."""
    torch.manual_seed(0)
    model = seq_ranker.SeqRanker().eval()
    for bags in (model.candidates, model.users, model.history):
        for table in bags.parameters():
            torch.nn.init.normal_(table, std=0.5)  # TorchRec's default init is near zero: scores would not differ
    path = tmp_path_factory.mktemp("own_model") / "ranker.pt"
    torch.save(model.state_dict(), path)
    return model, path


@pytest.fixture(scope="module")
def service(trained, tmp_path_factory):
    archive = build_archive(
        EXAMPLE / "seq_ranker.yaml", checkpoint=trained[1], seed=0, name="seq_ranker", version="1.0",
        model_store=tmp_path_factory.mktemp("store"), serving=ServingConfig(batch_size=8, max_batch_delay_ms=5),
        artifact=Artifact.EXPORTED, archive_format="no-archive",
    )
    return archive_service(archive)


def _request(rng: np.random.Generator, candidates: int, history: int) -> dict:
    user = int(rng.integers(0, 500))
    return {
        "items": [{"dense": [0.0], "sparse": {"candidate": [int(rng.integers(0, 2000))], "user_id": [user]}}
                  for _ in range(candidates)],
        "context_sparse": {"history": rng.integers(0, 2000, size=history).tolist()},
    }


def _model_scores(model, requests: list[dict]) -> torch.Tensor:
    """SeqRanker's own scores, its inputs made here with TorchRec's constructors."""
    items = [item for r in requests for item in r["items"]]

    def kjt(key: str, bags: list[list[int]]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_lengths_sync(
            keys=[key], values=torch.tensor([i for b in bags for i in b], dtype=torch.int64),
            lengths=torch.tensor([len(b) for b in bags], dtype=torch.int64),
        )

    with torch.inference_mode():
        logits = model(
            kjt("candidate", [i["sparse"]["candidate"] for i in items]),
            kjt("user_id", [i["sparse"]["user_id"] for i in items]),
            kjt("history", [r["context_sparse"]["history"] for r in requests]),
            torch.tensor([len(r["items"]) for r in requests]),
        )
    return torch.sigmoid(logits.reshape(-1))


def _served(service, requests: list[dict]) -> list[dict]:
    return [orjson.loads(r.body) for r in service.handle([orjson.dumps(r) for r in requests]).responses]


def test_served_alone_and_batched_as_the_model_scores(service, trained):
    rng = np.random.default_rng(1)
    requests = [_request(rng, 3, 0), _request(rng, 5, 7), _request(rng, 1, 0), _request(rng, 4, 2), _request(rng, 1, 6)]
    batched = _served(service, requests)
    for request, answer in zip(requests, batched):
        # alone, an empty history is padded with an item holding ids (one candidate an item still), and a
        # single candidate with a second item: the graph asserts two candidate rows (capture found it)
        alone = _served(service, [request])[0]
        expected = _model_scores(trained[0], [request])
        torch.testing.assert_close(torch.tensor(alone["scores"]), expected, atol=QUANTIZATION_TOLERANCE, rtol=0)
        torch.testing.assert_close(torch.tensor(answer["scores"]), torch.tensor(alone["scores"]), atol=1e-6, rtol=0)


def test_a_missing_or_second_id_is_refused_naming_it(service):
    rng = np.random.default_rng(2)
    no_user, two_candidates = _request(rng, 2, 3), _request(rng, 2, 3)
    del no_user["items"][1]["sparse"]["user_id"]
    two_candidates["items"][0]["sparse"]["candidate"].append(5)
    refused = _served(service, [no_user, two_candidates, _request(rng, 2, 3)])
    assert refused[0]["code"] == 400 and refused[0]["field"] == "items[1].sparse.user_id"
    assert refused[1]["code"] == 400 and refused[1]["field"] == "items[0].sparse.candidate"
    assert len(refused[2]["scores"]) == 2
