"""A user's own models through the real TorchServe: the DIN example package (installed, as a
user installs theirs; trained by its own script) served eager and AOT-compiled, and a user's
architecture from a folder the server's Python cannot import, served from an eager archive (which
carries its code) and from an exported graph (which needs none).

Requests carry a 200-item history once and 100 candidates; served scores equal the float model's
(inputs made with TorchRec's KeyedJaggedTensor, not the serving decoder) within the quantization
tolerance, and concurrent requests coalesced into shared forwards score exactly as alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from archive_tools.build import build_archive
from archive_tools.local_server import LocalTorchServe
from archive_tools.model_config import ServingConfig
from handlers.modeling.checkpoint import read_checkpoint
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec, synthetic_request
from handlers.runtime.archive_files import ARCHITECTURE, CODE
from handlers.runtime.artifacts import Artifact
from tests.handlers.modeling.user_architecture import USER_MODULE, USER_SPEC
from tests.helpers import QUANTIZATION_TOLERANCE

from din_ranker.data import to_batch, user_request  # isort: skip
from din_ranker.train import SPEC as DIN_SPEC  # isort: skip

pytestmark = pytest.mark.integration

SERVING = ServingConfig(batch_size=8, max_batch_delay_ms=100)
USER_PACKAGE = "towers_of_a_user"


@pytest.fixture(scope="module")
def din_checkpoint(tmp_path_factory) -> Path:
    """The example's own training script, run as its README says (a few steps)."""
    out = tmp_path_factory.mktemp("din") / "din.pt"
    done = subprocess.run(
        [sys.executable, "-m", "din_ranker.train", "--steps", "40", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "held-out AUC" in done.stdout
    return out


@pytest.fixture(scope="module")
def user_spec_file(tmp_path_factory) -> Path:
    """The user's package in a folder of its own, importable by this process only."""
    folder = tmp_path_factory.mktemp("users_code")
    (folder / USER_PACKAGE).mkdir()
    (folder / USER_PACKAGE / "__init__.py").write_text("")
    (folder / USER_PACKAGE / "model.py").write_text(USER_MODULE)
    sys.path.insert(0, str(folder))
    spec = folder / "two_tower.yaml"
    spec.write_text(yaml.safe_dump({**USER_SPEC, "architecture": f"{USER_PACKAGE}.model:TwoTowerArchitecture"}))
    yield spec
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def archives(tmp_path_factory, din_checkpoint, user_spec_file) -> dict[str, Path]:
    store = tmp_path_factory.mktemp("archives") / "model_store"
    builds = {
        "din_eager": (DIN_SPEC, din_checkpoint, Artifact.EAGER),
        "din_aoti": (DIN_SPEC, din_checkpoint, Artifact.AOTI),
        "towers_eager": (user_spec_file, None, Artifact.EAGER),
        "towers_exported": (user_spec_file, None, Artifact.EXPORTED),
    }
    return {
        name: build_archive(spec, checkpoint=checkpoint, seed=0, name=name, version="1.0", model_store=store,
                            serving=SERVING, artifact=artifact, archive_format="no-archive")
        for name, (spec, checkpoint, artifact) in builds.items()
    }


@pytest.fixture(scope="module")
def server(archives):
    with LocalTorchServe(model_store=next(iter(archives.values())).parent) as server:
        for name in archives:
            response = server.register(name, initial_workers=1)
            assert response.status_code == 200, f"{name}: {response.text}"
        yield server


def test_an_eager_archive_carries_the_users_package_and_a_graph_archive_does_not(archives):
    eager, graph = archives["towers_eager"], archives["towers_exported"]
    assert (eager / CODE / USER_PACKAGE / "model.py").read_text() == USER_MODULE
    assert not (graph / CODE).exists()
    record = json.loads((eager / ARCHITECTURE).read_text())
    assert record["contract_version"] == 1 and record["package"] == USER_PACKAGE
    server_python = subprocess.run(  # the server's interpreter, as TorchServe starts its workers
        [sys.executable, "-c", f"import {USER_PACKAGE}"], capture_output=True, text=True
    )
    assert server_python.returncode != 0, "the user's package must not be importable outside this process"


@pytest.mark.parametrize("model", ["towers_eager", "towers_exported"])
def test_a_users_architecture_serves_without_its_package_installed(server, model, user_spec_file):
    spec = load_spec(user_spec_file)
    float_model = DLRMFactory(spec).float_model(seed=0)
    request = synthetic_request(spec, 12, seed=3)
    response = server.predict(model, request)
    assert response.status_code == 200, response.text
    from tests.helpers import float_scores

    expected = float_scores(float_model, spec, request)
    torch.testing.assert_close(torch.tensor(response.json()["scores"]), expected, atol=QUANTIZATION_TOLERANCE, rtol=0)


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
    with ThreadPoolExecutor(max_workers=len(requests_)) as pool:
        batched = list(pool.map(lambda r: server.predict(model, r), requests_))
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
