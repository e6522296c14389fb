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
from archive_tools.verification import Bounds
from handlers.runtime.artifacts import Artifact
from handlers.runtime.service import ScoringService
from handlers.runtime.split import SplitPlan
from tests.conftest import TINY_SPEC
from tests.handlers.runtime.test_decode import BAD_REQUESTS
from tests.helpers import QUANTIZATION_TOLERANCE, archive_service, float_scores, items_request

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
    build_archive(  # a folder, not a zip, with tables made straight in their served dtypes
        TINY_SPEC, checkpoint=None, seed=5, name="tiny_folder", version="1.0", model_store=store,
        serving=ServingConfig(batch_size=BATCH_SIZE, max_batch_delay_ms=MAX_BATCH_DELAY_MS),
        bounds=Bounds(max_abs_score_diff=0.0), quantized_init=True, archive_format="no-archive",
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


def test_served_scores_equal_in_process_scores(server, reference, tiny_spec, tiny_float_model):
    """Against the archive loaded in this process, and against the float TorchRec model it was
    built from (inputs made without the serving decoder): within the quantization tolerance."""
    for n, seed in ((1, 1), (5, 2), (100, 3)):
        request = items_request(tiny_spec, n, seed=seed, max_bag=5, return_logits=True)
        response = server.predict("tiny", request)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("application/json")
        served, expected = response.json(), _expected(reference["1.0"], request)
        assert len(served["scores"]) == n
        floats = float_scores(tiny_float_model, tiny_spec, request)
        torch.testing.assert_close(torch.tensor(served["scores"]), floats, atol=QUANTIZATION_TOLERANCE, rtol=0)
        assert served["scores"] == pytest.approx(expected["scores"], abs=1e-5)
        assert served["logits"] == pytest.approx(expected["logits"], abs=1e-5)
        torch.testing.assert_close(
            torch.sigmoid(torch.tensor(served["logits"])), torch.tensor(served["scores"]), atol=1e-6, rtol=0
        )


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
    """The control for the graph workers above: the describe call does see TorchRec imported."""
    worker = _describe_worker(server, "tiny")
    assert worker["imports_torchrec"] and worker["runs"] == "eager (weights.pt)", worker


def _describe_worker(server: LocalTorchServe, name: str) -> dict:
    """What the model's worker reports about itself (GET /models/NAME?customized=true)."""
    described = server.management("GET", f"/models/{name}", params={"customized": "true"})
    assert described.status_code == 200, described.text
    return described.json()[0]["customizedMetadata"]


def test_unzipped_archive_of_random_quantized_tables_is_served(server, model_store, tiny_spec):
    folder = model_store / "tiny_folder"
    assert (folder / "MAR-INF" / "MANIFEST.json").exists() and (folder / "weights.pt").exists()
    response = server.register("tiny_folder", initial_workers=1)
    assert response.status_code == 200, response.text
    reference = archive_service(folder)
    request = items_request(tiny_spec, 9, seed=11, max_bag=4)
    served = server.predict("tiny_folder", request)
    assert served.status_code == 200, served.text
    assert served.json()["scores"] == pytest.approx(_expected(reference, request)["scores"], abs=1e-6)
    assert server.management("DELETE", "/models/tiny_folder").status_code == 200


def test_columnar_form_is_served(server, reference):
    body = {
        "float_features": [[0.5, -1.0, 2.0, 0.0]],
        "id_list_features.lengths": [2, 1, 0, 3, 1],
        "id_list_features.values": [1, 2, 3, 4, 5, 6, 7],
    }
    response = server.predict("tiny", body)
    assert response.status_code == 200, response.text
    assert response.json()["scores"] == pytest.approx(_expected(reference["1.0"], body)["scores"], abs=1e-5)


def test_concurrent_multi_hot_requests_score_as_alone(server, tiny_spec):
    """Different bag sizes and item counts, batched by TorchServe, get exactly their solo scores."""
    requests_ = [
        items_request(tiny_spec, n_items, seed=100 + i, max_bag=bag)
        for i, (n_items, bag) in enumerate([(1, 0), (3, 7), (1, 20), (17, 2), (2, 50), (8, 1)] * 4)
    ]
    alone = [server.predict("tiny", r).json()["scores"] for r in requests_]
    before = server.handler_counters("tiny")
    with ThreadPoolExecutor(max_workers=len(requests_)) as pool:
        together = list(pool.map(lambda r: server.predict("tiny", r), requests_))
    formed = server.handler_counters("tiny").minus(before)
    for response, solo in zip(together, alone):
        assert response.status_code == 200, response.text
        assert response.json()["scores"] == pytest.approx(solo, abs=1e-6)
    assert formed.requests == len(requests_)
    assert max(formed.batches) > 1, f"TorchServe formed no batch of several requests: {formed}"


def test_bad_requests_get_400_naming_the_field_and_spare_the_batch(server, reference, tiny_spec):
    good = [items_request(tiny_spec, 2, seed=200 + i, max_bag=4) for i in range(6)]
    bad = [(body if isinstance(body, bytes) else json.dumps(body), field) for body, field, _ in BAD_REQUESTS]
    mixed: list = []
    for i, (body, field) in enumerate(bad):
        mixed.append(("bad", body, field))
        mixed.append(("good", good[i % len(good)], None))
    with ThreadPoolExecutor(max_workers=16) as pool:
        responses = list(pool.map(lambda m: server.predict("tiny", m[1]), mixed))
    for (kind, body, field), response in zip(mixed, responses):
        if kind == "bad":
            assert response.status_code == 400, (body, response.text)
            assert response.json()["field"] == field
        else:
            assert response.status_code == 200, response.text
            assert response.json()["scores"] == pytest.approx(
                _expected(reference["1.0"], body)["scores"], abs=1e-5
            )
    server.check_alive()
    assert server.predict("tiny", good[0]).status_code == 200


def test_request_over_size_limit_is_refused(server):
    body = b'{"items": [' + b" " * (7 * 2**20) + b"]}"
    response = server.predict("tiny", body)
    assert response.status_code == 413
    assert "limits.max_request_bytes" in response.json()["message"]
    server.check_alive()


def test_requests_without_a_valid_token_are_refused(server, tiny_spec):
    """TorchServe 0.12 answers a missing or wrong key with 400 InvalidKeyException."""
    body = json.dumps(items_request(tiny_spec, 1, seed=1))
    wrong = {"Authorization": "Bearer not-the-key"}
    for response in (
        requests.post(f"{server.inference_url}/predictions/tiny", data=body, timeout=30),
        requests.post(f"{server.inference_url}/predictions/tiny", data=body, headers=wrong, timeout=30),
        requests.get(f"{server.management_url}/models", timeout=30),
        requests.get(f"{server.management_url}/models", headers=server.auth("inference"), timeout=30),
    ):
        assert response.status_code == 400, response.text
        assert response.json()["type"] == "InvalidKeyException"
        assert "Token Authorization failed" in response.json()["message"]


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
