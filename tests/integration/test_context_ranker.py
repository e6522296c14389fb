"""The second model through the same handler machinery: a context ranker served by a real
TorchServe with batch_size 32. Concurrent requests of different sizes, each with its own context
and weighted ids, are coalesced into shared forwards and still get exactly their solo scores.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.local_server import LocalTorchServe
from handlers.runtime.service import ScoringService
from tests.conftest import RANKER_SPEC
from tests.handlers.runtime.test_decode import RANKER_BAD_REQUESTS
from tests.helpers import QUANTIZATION_TOLERANCE, archive_service, float_scores, items_request

pytestmark = pytest.mark.integration

BATCH_SIZE = 32
MAX_BATCH_DELAY_MS = 200  # long enough that a burst of concurrent requests shares TorchServe batches


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    return build_archive(
        RANKER_SPEC,
        checkpoint=None,
        seed=0,
        name="ranker",
        version="1.0",
        model_store=tmp_path_factory.mktemp("archives") / "model_store",
        serving=ServingConfig(batch_size=BATCH_SIZE, max_batch_delay_ms=MAX_BATCH_DELAY_MS),
    )


@pytest.fixture(scope="module")
def reference(archive, tmp_path_factory) -> ScoringService:
    return archive_service(archive)


@pytest.fixture(scope="module")
def server(archive):
    with LocalTorchServe(model_store=archive.parent) as server:
        response = server.register(archive.name, initial_workers=1)  # batching from model-config.yaml
        assert response.status_code == 200, response.text
        yield server


def _solo(reference: ScoringService, request: dict) -> list[float]:
    return json.loads(reference.handle([json.dumps(request).encode()]).responses[0].body)["scores"]


def test_concurrent_requests_share_forwards_and_score_as_alone(server, reference, ranker_spec, ranker_float_model):
    """Batched scores equal each request's alone, and the float TorchRec model's (inputs made
    without the serving decoder) within the quantization tolerance."""
    requests_ = [
        items_request(ranker_spec, n_items, seed=i, max_bag=bag)
        for i, (n_items, bag) in enumerate([(1, 0), (100, 3), (7, 50), (30, 1)] * 16)
    ]
    before = server.handler_counters("ranker")
    with ThreadPoolExecutor(max_workers=len(requests_)) as pool:
        responses = list(pool.map(lambda r: server.predict("ranker", r), requests_))
    formed = server.handler_counters("ranker").minus(before)

    for request, response in zip(requests_, responses):
        assert response.status_code == 200, response.text
        assert response.json()["scores"] == pytest.approx(_solo(reference, request), abs=1e-6)
        floats = float_scores(ranker_float_model, ranker_spec, request)
        torch.testing.assert_close(torch.tensor(response.json()["scores"]), floats, atol=QUANTIZATION_TOLERANCE, rtol=0)
    assert formed.requests == len(requests_)
    assert max(formed.batches) > 1, f"TorchServe formed no batch of several requests: {formed}"
    items_per_request = sum(len(r["items"]) for r in requests_) / len(requests_)
    assert formed.mean_items_per_forward >= 2 * items_per_request, formed


def test_bad_requests_in_a_batch_get_their_own_400(server, reference, ranker_spec):
    good = [items_request(ranker_spec, 4, seed=50 + i) for i in range(len(RANKER_BAD_REQUESTS))]
    mixed = [m for (body, field, _), g in zip(RANKER_BAD_REQUESTS, good) for m in ((body, field), (g, None))]
    with ThreadPoolExecutor(max_workers=len(mixed)) as pool:
        responses = list(pool.map(lambda m: server.predict("ranker", m[0]), mixed))
    for (body, field), response in zip(mixed, responses):
        if field is None:
            assert response.status_code == 200, response.text
            assert response.json()["scores"] == pytest.approx(_solo(reference, body), abs=1e-6)
        else:
            assert response.status_code == 400, (body, response.text)
            assert response.json()["field"] == field
    server.check_alive()
