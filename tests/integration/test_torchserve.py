"""The real thing: archives built by torch-model-archiver, served by a real TorchServe subprocess.

One server per module (free loopback ports, token authorization on), stopped by pid at the end.
Scores are compared with the in-process model loaded from the archive's own files.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.local_server import LocalTorchServe
from handlers.runtime.artifacts import Artifact
from handlers.runtime.service import ScoringService
from handlers.runtime.split import SplitPlan
from tests.conftest import TINY_SPEC
from tests.helpers import archive_service, items_request

pytestmark = pytest.mark.integration

BATCH_SIZE = 8
MAX_BATCH_DELAY_MS = 100  # long enough that concurrent requests land in one TorchServe batch
SPLIT_PLAN = SplitPlan(sparse=Artifact.EXPORTED, dense=Artifact.AOTI)


def _build(store: Path, seed: int, version: str) -> Path:
    return build_archive(
        TINY_SPEC,
        checkpoint=None,
        seed=seed,
        name="tiny",
        version=version,
        model_store=store,
        serving=ServingConfig(batch_size=BATCH_SIZE, max_batch_delay_ms=MAX_BATCH_DELAY_MS),
    )


@pytest.fixture(scope="module")
def model_store(tmp_path_factory) -> Path:
    """tiny.mar (v1.0, seed 0) and tiny_v2.mar (v2.0, seed 1) in a folder named model_store."""
    root = tmp_path_factory.mktemp("archives")
    store = root / "model_store"
    _build(store, seed=0, version="1.0")
    v2 = _build(root / "v2", seed=1, version="2.0")
    shutil.copy(v2, store / "tiny_v2.mar")
    for artifact in (Artifact.EXPORTED, Artifact.AOTI, Artifact.SPLIT):  # seed 0 again, as graphs
        build_archive(
            TINY_SPEC, checkpoint=None, seed=0, name=f"tiny_{artifact.value}", version="1.0",
            model_store=store, serving=ServingConfig(batch_size=BATCH_SIZE, max_batch_delay_ms=MAX_BATCH_DELAY_MS),
            artifact=artifact,
            split=SPLIT_PLAN if artifact == Artifact.SPLIT else None,
        )
    return store


def _in_process(archive: Path, tmp: Path) -> ScoringService:
    return archive_service(archive)


@pytest.fixture(scope="module")
def reference(model_store, tmp_path_factory) -> dict[str, ScoringService]:
    return {
        "1.0": _in_process(model_store / "tiny.mar", tmp_path_factory.mktemp("v1")),
        "2.0": _in_process(model_store / "tiny_v2.mar", tmp_path_factory.mktemp("v2")),
    }


@pytest.fixture(scope="module")
def server(model_store):
    with LocalTorchServe(model_store=model_store) as server:
        response = server.register(
            "tiny.mar", batch_size=BATCH_SIZE, max_batch_delay=MAX_BATCH_DELAY_MS, initial_workers=1
        )
        assert response.status_code == 200, response.text
        yield server


def _expected(service: ScoringService, request: dict) -> dict:
    return json.loads(service.handle([json.dumps(request).encode()]).responses[0].body)




@pytest.mark.parametrize("artifact", [Artifact.EXPORTED, Artifact.AOTI, Artifact.SPLIT])
def test_exported_compiled_and_split_archives_answer_like_eager(server, reference, tiny_spec, artifact):
    name = f"tiny_{artifact.value}"
    files = SPLIT_PLAN.files if artifact == Artifact.SPLIT else artifact.files()
    with zipfile.ZipFile(server.model_store / f"{name}.mar") as z:
        assert set(files) <= set(z.namelist()) and "weights.pt" not in z.namelist()
    response = server.register(f"{name}.mar", initial_workers=1)
    assert response.status_code == 200, response.text
    requests_ = [items_request(tiny_spec, n, seed=40 + n, max_bag=5) for n in (1, 6, 33)]
    with ThreadPoolExecutor(max_workers=len(requests_)) as pool:
        responses = list(pool.map(lambda r: server.predict(name, r), requests_))
    for request, served in zip(requests_, responses):
        assert served.status_code == 200, served.text
        assert served.json()["scores"] == pytest.approx(_expected(reference["1.0"], request)["scores"], abs=1e-6)
    worker = _describe_worker(server, name)
    assert not worker["imports_torchrec"] and not worker["imports_torchao"], worker
    assert worker["runs"].startswith(artifact.value)
    running = (
        f"sparse {SPLIT_PLAN.sparse_file}, dense {SPLIT_PLAN.dense_file} on cpu"
        if artifact == Artifact.SPLIT
        else artifact.file_name()
    )
    assert f"running {artifact.value} ({running})" in server.log_tail(200_000)
    assert server.management("DELETE", f"/models/{name}").status_code == 200


def test_an_eager_worker_runs_torchrec_modules(server):
    """The control for the graph workers above: the describe call does see TorchRec imported. The
    worker's garbage collector, paused for its start, is on again."""
    worker = _describe_worker(server, "tiny")
    assert worker["imports_torchrec"] and worker["runs"] == "eager (weights.pt)", worker
    assert worker["collector"] == {"enabled": True}, worker


def _describe_worker(server: LocalTorchServe, name: str) -> dict:
    """What the model's worker reports about itself (GET /models/NAME?customized=true)."""
    described = server.management("GET", f"/models/{name}", params={"customized": "true"})
    assert described.status_code == 200, described.text
    return described.json()[0]["customizedMetadata"]




def test_columnar_form_is_served(server, reference):
    body = {
        "float_features": [[0.5, -1.0, 2.0, 0.0]],
        "id_list_features.lengths": [2, 1, 0, 3, 1],
        "id_list_features.values": [1, 2, 3, 4, 5, 6, 7],
    }
    response = server.predict("tiny", body)
    assert response.status_code == 200, response.text
    assert response.json()["scores"] == pytest.approx(_expected(reference["1.0"], body)["scores"], abs=1e-5)










def test_management_api_versions_scale_and_unregister(server, reference, tiny_spec):
    request = items_request(tiny_spec, 4, seed=300, max_bag=3)
    v1, v2 = (_expected(reference[v], request)["scores"] for v in ("1.0", "2.0"))
    assert v1 != pytest.approx(v2, abs=1e-4), "the two versions must score differently"

    assert server.register("tiny_v2.mar", initial_workers=1).status_code == 200
    listed = server.management("GET", "/models").json()["models"]
    assert [m["modelName"] for m in listed] == ["tiny"]
    described = server.management("GET", "/models/tiny/all").json()
    assert sorted(d["modelVersion"] for d in described) == ["1.0", "2.0"]

    assert server.predict("tiny", request).json()["scores"] == pytest.approx(v1, abs=1e-5)
    assert server.predict("tiny", request, version="2.0").json()["scores"] == pytest.approx(v2, abs=1e-5)
    assert server.management("PUT", "/models/tiny/2.0/set-default").status_code == 200
    assert server.predict("tiny", request).json()["scores"] == pytest.approx(v2, abs=1e-5)

    scaled = server.management("PUT", "/models/tiny/2.0", params={"min_worker": 2, "synchronous": "true"})
    assert scaled.status_code == 200, scaled.text
    workers = server.management("GET", "/models/tiny/2.0").json()[0]["workers"]
    assert len(workers) == 2
    assert server.predict("tiny", request).json()["scores"] == pytest.approx(v2, abs=1e-5)

    assert server.management("DELETE", "/models/tiny/1.0").status_code == 200
    assert server.predict("tiny", request, version="1.0").status_code == 404
    assert server.management("DELETE", "/models/tiny/2.0").status_code == 200
    assert server.management("GET", "/models/tiny").status_code == 404
    assert server.predict("tiny", request).status_code == 404
