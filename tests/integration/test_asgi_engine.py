"""What the ASGI engine serves beyond the behaviour both engines share (``test_serving.py``):
``torchrec-serve serve --engine asgi`` as a subprocess on a free loopback port, checked against
the same archives loaded in this process (``tests.helpers.archive_service``): the v2 protocol for
the project's client and Triton's, its probes and statistics behind keys, a chunked body over the
limit, admission's 503s, a batch that stops waiting once every connection waits on it. One server
for the module (one process).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as triton

from archive_tools.build import build_archive
from archive_tools.client import ScoringClient
from archive_tools.model_config import ServingConfig
from handlers.runtime.service import ScoringService
from handlers.runtime.wire.transport import Arrival
from handlers.runtime.wire.v2_headers import HEADER_LENGTH
from handlers.runtime.wire.v2_tensors import encode_request
from tests.conftest import TINY_SPEC
from tests.helpers import archive_service, items_request
from tests.integration.engines import AsgiServer, stop_leaving_nothing

pytestmark = pytest.mark.integration

BATCH_SIZE = 8
MAX_BATCH_DELAY_MS = 50  # long enough that concurrent requests land in one batch
GUARDED = "tiny_guarded"  # one request per batch, a 1 ms wait target: a second request waiting is shed
PATIENT = "tiny_patient"  # batches of 8 that wait up to PATIENT_DELAY_MS to fill
PATIENT_DELAY_MS = 2000


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """tiny.mar, tiny_guarded.mar (admission) and tiny_patient.mar (a long batch delay)."""
    store = tmp_path_factory.mktemp("asgi") / "model_store"
    serving = ServingConfig(batch_size=BATCH_SIZE, max_batch_delay_ms=MAX_BATCH_DELAY_MS)
    build_archive(TINY_SPEC, checkpoint=None, seed=0, name="tiny", version="1.0", model_store=store, serving=serving)
    build_archive(TINY_SPEC, checkpoint=None, seed=0, name=GUARDED, version="1.0", model_store=store,
                  serving=ServingConfig(batch_size=1, max_batch_delay_ms=1, max_queue_wait_ms=1))
    build_archive(TINY_SPEC, checkpoint=None, seed=0, name=PATIENT, version="1.0", model_store=store,
                  serving=ServingConfig(batch_size=BATCH_SIZE, max_batch_delay_ms=PATIENT_DELAY_MS))
    return store


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    server = AsgiServer(store, ["tiny.mar", f"{GUARDED}.mar", f"{PATIENT}.mar"], 1, tmp_path_factory.mktemp("asgi-server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(store) -> dict[str, ScoringService]:
    return {"tiny": archive_service(store / "tiny.mar")}


def _in_process(service: ScoringService, body: bytes | str | dict, content_type: str = "application/json", **headers):
    """The in-process service's answer to one request sent alone: (status, body bytes)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
    form = content_type.startswith(("application/x-www-form-urlencoded", "multipart/form-data"))
    arrival = Arrival(None if form else data, content_type, headers.get("encoding"), headers.get("header_length"))
    response = service.handle([arrival]).responses[0]
    return response.status, response.body


def test_v2_json_binary_and_triton_clients(server, store, reference, tiny_spec):
    request = items_request(tiny_spec, 6, seed=77, max_bag=3)
    expected = json.loads(_in_process(reference["tiny"], request)[1])["scores"]
    client = ScoringClient.from_archive("tiny", store / "tiny.mar", rest_url=server.url, token=server.key)
    assert client.score(request["items"]).tolist() == pytest.approx(expected, abs=1e-6)  # binary tensors
    arrays = client.tensors(request["items"])
    v2_json = {"id": "r1", "inputs": [
        {"name": name, "datatype": "FP32" if a.dtype == np.float32 else "INT64", "shape": list(a.shape),
         "data": a.reshape(-1).tolist()} for name, a in arrays.items()]}
    for path in ("/v2/models/tiny/infer", "/v2/models/tiny/versions/1.0/infer"):
        answer = server.post(path, v2_json).json()
        assert answer["model_name"] == "tiny" and answer["id"] == "r1" and answer["model_version"] == "1.0"
        assert answer["outputs"][0]["data"] == pytest.approx(expected, abs=1e-6)
    triton_client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    inputs = []
    for name, array in arrays.items():
        tensor = triton.InferInput(name, list(array.shape), "FP32" if array.dtype == np.float32 else "INT64")
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    result = triton_client.infer("tiny", inputs, outputs=[triton.InferRequestedOutput("scores", binary_data=True)],
                                 headers=dict(server.auth))  # it adds its own headers to the dict
    assert result.as_numpy("scores").tolist() == pytest.approx(expected, abs=1e-6)
    assert triton_client.is_server_live() and triton_client.is_server_ready()
    assert triton_client.is_model_ready("tiny", headers=dict(server.auth))  # it adds its own headers to the dict
    metadata = triton_client.get_model_metadata("tiny", headers=dict(server.auth))  # it adds its own headers to the dict
    assert metadata["versions"] == ["1.0"] and {i["name"] for i in metadata["inputs"]} == set(arrays)
    body, json_length = encode_request(arrays)
    truncated = server.post("/v2/models/tiny/infer", body[:-8],
                            headers={"Content-Type": "application/octet-stream", HEADER_LENGTH: str(json_length)})
    assert truncated.status_code == 400 and "the body is shorter than the header says" in truncated.json()["error"]
    client.close()


def test_health_readiness_and_unknown_models(server):
    for path in ("/v2/health/live", "/v2/health/ready", "/ping"):
        assert requests.get(f"{server.url}{path}", timeout=10).status_code == 200  # no key: probes
    ready = requests.get(f"{server.url}/v2/models/tiny/ready", headers=server.auth, timeout=10)
    assert ready.json() == {"name": "tiny", "ready": True}
    missing = server.post("/predictions/nope", {"items": []})
    assert (missing.status_code, missing.json()["type"]) == (404, "ModelNotFoundException")
    assert server.post("/predictions/tiny/9.9", {"items": []}).status_code == 404
    v2_missing = requests.get(f"{server.url}/v2/models/nope", headers=server.auth, timeout=10)
    assert v2_missing.status_code == 404 and "nope" in v2_missing.json()["error"]


def test_a_missing_or_wrong_key_is_refused_on_the_v2_model_routes(server):
    """The routes TorchServe has not (the inference routes both have: ``test_serving.py``)."""
    for path in ("/v2/models/tiny", "/v2/models/tiny/ready", "/v2/models/tiny/stats", "/v2/models/nope"):
        for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": server.key}):
            response = requests.get(f"{server.url}{path}", headers=headers, timeout=10)
            assert response.status_code == 400, (path, headers, response.text)
            assert response.json()["type"] == "InvalidKeyException"
            assert "Token Authorization failed" in response.json()["message"]


def test_a_chunked_body_over_the_limit_is_refused_unread(server):
    """Its size is not known ahead: the engine reads no further than the limit (a body whose length
    is known: ``test_serving.py``)."""
    body = b'{"items": [' + b" " * (7 * 2**20) + b"]}"
    chunked = requests.post(f"{server.url}/v2/models/tiny/infer", data=iter([body[:2**20]] * 7),
                            headers={**server.auth, "Content-Type": "application/json"}, timeout=60)
    assert chunked.status_code == 413
    assert chunked.json()["message"].startswith("body: over the model's limit of 6,291,456 bytes")
    assert server.process.poll() is None


def test_requests_over_the_wait_target_get_a_fast_503(server, tiny_spec):
    """Each batch of tiny_guarded takes one request of 250 items (over its 1 ms target); once one
    batch was measured with requests behind it, a request arriving while another waits is shed,
    before it reaches a forward."""
    big = json.dumps(items_request(tiny_spec, 250, seed=9, max_bag=8))
    before = sum(size * count for size, count in server.stats(GUARDED).items())
    expected = server.post(f"/predictions/{GUARDED}", big)
    assert expected.status_code == 200, expected.text
    outcomes = []
    for burst in (4, 24):
        with ThreadPoolExecutor(max_workers=burst) as pool:
            outcomes += list(pool.map(lambda _: server.post(f"/predictions/{GUARDED}", big), range(burst)))
    shed = [r for r in outcomes if r.status_code == 503]
    served = [r for r in outcomes if r.status_code == 200]
    assert shed and served and len(shed) + len(served) == len(outcomes), [r.status_code for r in outcomes]
    assert all(r.content == expected.content for r in served)
    body = shed[0].json()
    assert body["type"] == "ServiceUnavailable" and shed[0].headers["Retry-After"] == "1"
    assert f"model {GUARDED} version 1.0 is overloaded" in body["message"] and "max_queue_wait_ms" in body["message"]
    # shed at admission, never queued for a forward: the requests that reached one are the served
    # (a latency comparison flaked on a loaded machine: the speed of a 503 is a benchmark's figure)
    forwarded = sum(size * count for size, count in server.stats(GUARDED).items()) - before
    assert forwarded == 1 + len(served), (forwarded, len(served), len(shed))


def test_a_batch_stops_waiting_once_every_open_connection_waits_on_it(server, tiny_spec):
    """Three keep-alive clients, each request on its own connection: the third to arrive leaves no
    connection that could bring a fourth, so the batch of three runs at once rather than after
    the archive's 2 s delay. With a fourth connection open and idle, the batch waits the delay out."""
    request = items_request(tiny_spec, 2, seed=4)
    url = f"{server.url}/predictions/{PATIENT}"

    def batch_of(clients: int, idle: int) -> float:
        """Seconds until ``clients`` concurrent requests are answered, ``idle`` more connections open."""
        before = server.stats(PATIENT)  # first: its connection closes, so none but the sessions' are open
        sessions = [requests.Session() for _ in range(clients + idle)]
        for session in sessions:
            assert session.get(f"{server.url}/ping", timeout=10).status_code == 200  # its connection, kept open
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=clients) as pool:
            answers = list(pool.map(lambda s: s.post(url, json=request, headers=server.auth, timeout=30), sessions[:clients]))
        elapsed = time.monotonic() - started
        assert [a.status_code for a in answers] == [200] * clients, [a.text for a in answers]
        formed = {size: count - before.get(size, 0) for size, count in server.stats(PATIENT).items()}
        assert {size: n for size, n in formed.items() if n} == {clients: 1}, formed  # one batch of them all
        for session in sessions:
            session.close()
        return elapsed

    assert batch_of(3, idle=0) < PATIENT_DELAY_MS / 1000 / 2
    assert batch_of(3, idle=1) >= PATIENT_DELAY_MS / 1000


def test_a_stopped_server_leaves_nothing_behind(server):
    """Runs last (it stops the module's server). One process: uvicorn, shut down by SIGTERM,
    raises it again to end by it, which ended the process before its folders were removed."""
    stop_leaving_nothing(server)
