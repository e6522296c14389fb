"""A user's own model through the real TorchServe: the DIN example package (installed, as a user
installs theirs; trained by its own script) built eager and AOT-compiled, and served by a server
whose Python cannot import that package (a shadowing ``din_ranker`` that refuses to import comes
first on its path): the compiled archive needs no code, the eager one runs the copy it carries.

Requests carry a history of up to 500 items once and 100 candidates; served scores equal the float
model's (inputs made with TorchRec's KeyedJaggedTensor, not the serving decoder) within the
quantization tolerance, concurrent requests coalesced into shared forwards score exactly as alone,
and a row delta of the sequence table serves what a fresh build serves, then rolls back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import din_ranker
from archive_tools.build import build_archive
from archive_tools.delta import DeltaSource, make_delta
from archive_tools.local_server import LocalTorchServe
from archive_tools.model_config import ServingConfig
from handlers.modeling.checkpoint import read_checkpoint
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.runtime.archive_files import ARCHITECTURE, CODE
from handlers.runtime.artifacts import Artifact
from tests.helpers import QUANTIZATION_TOLERANCE

from din_ranker.data import to_batch, user_request  # isort: skip
from din_ranker.train import SPEC as DIN_SPEC, train  # isort: skip

pytestmark = pytest.mark.integration

SERVING = ServingConfig(batch_size=8, max_batch_delay_ms=100)
PACKAGE = Path(din_ranker.__file__).parent


@pytest.fixture(scope="module")
def din_checkpoint(tmp_path_factory) -> Path:
    """The example's own training script (a few steps)."""
    out = tmp_path_factory.mktemp("din") / "din.pt"
    auc = train(DIN_SPEC, steps=30, out=out)
    assert auc > 0.6, f"30 steps on synthetic users should learn something, held-out AUC {auc:.3f}"
    return out


@pytest.fixture(scope="module")
def archives(tmp_path_factory, din_checkpoint) -> dict[str, Path]:
    store = tmp_path_factory.mktemp("archives") / "model_store"
    return {
        name: build_archive(DIN_SPEC, checkpoint=din_checkpoint, seed=0, name=name, version="1.0", model_store=store,
                            serving=SERVING, artifact=artifact, archive_format="no-archive")
        for name, artifact in (("din_eager", Artifact.EAGER), ("din_aoti", Artifact.AOTI))
    }


@pytest.fixture(scope="module")
def no_package_env(tmp_path_factory) -> dict[str, str]:
    """An environment whose Python finds a ``din_ranker`` that refuses to import before the installed one."""
    shadow = tmp_path_factory.mktemp("shadow")
    (shadow / "din_ranker").mkdir()
    (shadow / "din_ranker" / "__init__.py").write_text("raise ImportError('the server must not import din_ranker')\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def server(archives, no_package_env):
    with LocalTorchServe(model_store=next(iter(archives.values())).parent, env=no_package_env) as server:
        for name in archives:
            response = server.register(name, initial_workers=1)
            assert response.status_code == 200, f"{name}: {response.text}"
        yield server


def test_the_servers_python_cannot_import_the_package(no_package_env):
    python = subprocess.run(
        [sys.executable, "-c", "import din_ranker"], capture_output=True, text=True, env={**os.environ, **no_package_env}
    )
    assert python.returncode != 0 and "the server must not import din_ranker" in python.stderr


def test_the_eager_archive_carries_the_package_and_the_compiled_one_does_not(archives):
    eager, compiled = archives["din_eager"], archives["din_aoti"]
    assert (eager / CODE / "din_ranker" / "model.py").read_bytes() == (PACKAGE / "model.py").read_bytes()
    assert not (compiled / CODE).exists()
    for archive, package in ((eager, "din_ranker"), (compiled, None)):
        record = json.loads((archive / ARCHITECTURE).read_text())
        assert (record["architecture"], record["contract_version"], record["package"]) == ("din", 1, package)
        assert record["path"] == "din_ranker.model:ARCHITECTURE"  # found by it where the entry point is not


def _din_float(din_checkpoint):
    spec = load_spec(DIN_SPEC)
    factory = DLRMFactory(spec)
    model = factory.float_model(seed=0)
    factory.load_checkpoint(model, read_checkpoint(din_checkpoint))
    return model


@pytest.mark.parametrize("model", ["din_eager", "din_aoti"])
def test_din_scores_equal_the_float_model_and_batched_equal_solo(server, model, din_checkpoint):
    rng = np.random.default_rng(7)
    requests_ = [user_request(rng, history, 100)[0] for history in (200, 0, 57, 500, 1, 200, 120, 33)]
    solo = [server.predict(model, r) for r in requests_]
    before = server.handler_counters(model)
    with ThreadPoolExecutor(max_workers=len(requests_)) as pool:
        batched = list(pool.map(lambda r: server.predict(model, r), requests_))
    formed = server.handler_counters(model).minus(before)
    assert max(formed.batches) > 1, f"TorchServe formed no batch of several requests: {formed}"
    float_model = _din_float(din_checkpoint)
    for request, alone, together in zip(requests_, solo, batched):
        assert alone.status_code == 200 and together.status_code == 200, (alone.text, together.text)
        assert together.json()["scores"] == pytest.approx(alone.json()["scores"], abs=1e-6)
        batch = to_batch([request], [])
        with torch.inference_mode():
            logits = float_model(batch.dense, batch.sparse, batch.history, batch.item_counts)
        torch.testing.assert_close(
            torch.tensor(alone.json()["scores"]), torch.sigmoid(logits.reshape(-1)), atol=QUANTIZATION_TOLERANCE, rtol=0
        )


def test_a_history_over_its_limit_or_out_of_range_is_a_400_naming_the_feature(server):
    request, _ = user_request(np.random.default_rng(1), 501, 3)
    response = server.predict("din_eager", request)
    assert response.status_code == 400
    assert "context_sparse.history: 501 ids exceed the limit of 500 per sequence" in response.text
    request["context_sparse"]["history"] = [5, 20_000]
    response = server.predict("din_aoti", request)
    assert response.status_code == 400
    assert "context_sparse.history[1]: id 20000 is outside the table's 20000 rows" in response.text


def _moved(checkpoint: Path) -> Path:
    """``checkpoint`` with 40% of its item table's rows moved (more training, in short)."""
    state = torch.load(checkpoint, weights_only=True)
    generator = torch.Generator().manual_seed(5)
    rows = state["item_embeddings.embeddings.t_item.weight"]
    touched = torch.rand(rows.shape[0], generator=generator) < 0.4
    rows[touched] += 0.1 * torch.randn(rows[touched].shape, generator=generator)
    torch.save(state, checkpoint.with_name("din-moved.pt"))
    return checkpoint.with_name("din-moved.pt")


@pytest.fixture(scope="module")
def moved(din_checkpoint):
    """A checkpoint whose item table moved, and what a fresh build of it serves (the build's
    quantization, in process)."""
    checkpoint = _moved(din_checkpoint)
    factory = DLRMFactory(load_spec(DIN_SPEC))
    float_model = factory.float_model(seed=0)
    factory.load_checkpoint(float_model, read_checkpoint(checkpoint))
    return checkpoint, eager_service(factory.spec, factory.inference_model(factory.quantize(float_model)))


@pytest.mark.parametrize("model", ["din_eager", "din_aoti"])
def test_a_row_delta_of_the_sequence_table_serves_what_a_fresh_build_serves_and_rolls_back(
    server, archives, model, moved
):
    checkpoint, fresh = moved
    deltas = archives[model].parent / "deltas"
    deltas.mkdir(exist_ok=True)
    summary = make_delta(archives[model], DeltaSource(checkpoint=checkpoint), deltas / f"{model}-1.delta", sequence=1)
    assert set(summary.rows_by_table) == {"t_item"} and summary.rows_by_table["t_item"] > 1000
    request = user_request(np.random.default_rng(11), 300, 100)[0]
    before = server.predict(model, request).json()["scores"]
    published = server.management("POST", f"/freshness/{model}", params={"delta": f"{model}-1.delta"})
    assert published.status_code == 200, published.text
    _wait_applied(server, model, 1)
    expected = json.loads(fresh.handle([json.dumps(request).encode()]).responses[0].body)["scores"]
    assert server.predict(model, request).json()["scores"] == pytest.approx(expected, abs=1e-6)
    assert server.management("POST", f"/freshness/{model}", params={"rollback_to": 0}).status_code == 200
    _wait_applied(server, model, 0, rolled_back=True)
    assert server.predict(model, request).json()["scores"] == pytest.approx(before, abs=1e-6)


def _wait_applied(server, model: str, sequence: int, rolled_back: bool = False, timeout_s: float = 30) -> None:
    server.freshness_when(
        model,
        lambda state: state["applied_sequence"] == sequence and (not rolled_back or state.get("rolling_back_to") is None),
        timeout_s,
    )
