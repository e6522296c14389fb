"""The asgi engine's management routes on a real ``--workers 2`` server (a subprocess): models
registered, versioned and unregistered by archive name in every process; the management key
alone opens them; both processes take the gRPC port's connections. (Deltas published under load and a killed process restarted: on both engines,
``test_serving.py``.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as triton_grpc

from archive_tools.build import build_archive
from archive_tools.client import ScoringClient
from archive_tools.model_config import ServingConfig
from handlers.runtime.artifacts import Artifact
from tests.conftest import TINY_SPEC
from tests.helpers import archive_service
from tests.integration.publishing_archives import build, checkpoints
from tests.integration.engines import AsgiServer, serving_processes, stop_leaving_nothing
from tests.integration.test_publishing import REQUESTS, SPEC, _scores

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("asgi-mgmt")
    base, _ = checkpoints(root)
    store = root / "model_store"
    build(base, store, "tiny", Artifact.EAGER)  # version 1.0
    build_archive(TINY_SPEC, checkpoint=None, seed=5, name="tiny", version="2.0", model_store=root / "v2",
                  serving=ServingConfig(batch_size=8, max_batch_delay_ms=5))
    shutil.move(root / "v2" / "tiny.mar", store / "tiny-v2.mar")
    expected = {"old": _scores(archive_service(store / "tiny.mar")), "v2": _scores(archive_service(store / "tiny-v2.mar"))}
    return {"store": store, "expected": expected}


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    server = AsgiServer(setup["store"], ["tiny.mar"], 2, tmp_path_factory.mktemp("asgi-mgmt-server"))
    serving_processes(server, "tiny", 2)  # both processes serve before the tests start
    yield server
    server.stop()


def _served(server: AsgiServer, path: str) -> list[float]:
    """Every request's scores, each sent three times on new connections (to either process): the
    same answer each time."""
    answers = [[server.post(path, r) for _ in range(3)] for r in REQUESTS]
    assert all(a.status_code == 200 for sent in answers for a in sent), [a.text for sent in answers for a in sent]
    assert all(len({a.text for a in sent}) == 1 for sent in answers), [[a.text for a in sent] for sent in answers]
    return [x for sent in answers for x in sent[0].json()["scores"]]


def test_management_routes_take_the_management_key_alone(server):
    inference = server.auth
    assert requests.get(f"{server.url}/models", headers=inference, timeout=10).status_code == 400
    assert requests.get(f"{server.url}/freshness/tiny", timeout=10).status_code == 400
    assert server.manage("GET", "/models").json() == {"models": [{"modelName": "tiny", "modelUrl": "tiny.mar"}]}
    predicted = requests.post(f"{server.url}/predictions/tiny", json=REQUESTS[0], headers=server.management_auth, timeout=10)
    assert predicted.status_code == 400 and predicted.json()["type"] == "InvalidKeyException"


def test_the_supervisor_of_the_serving_processes_loads_no_torch(server):
    """uvicorn's supervisor starts and watches the processes and serves nothing: it never loads
    torch (seconds of CPU at every start, hundreds of MiB for its life)."""
    serving = set(serving_processes(server, "tiny", 2))
    assert server.process.pid not in serving
    for pid, loads_torch in ((server.process.pid, False), *((p, True) for p in serving)):
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert ("libtorch_cpu.so" in maps) == loads_torch, (pid, loads_torch)


def test_versions_are_registered_defaulted_and_unregistered_in_every_process(setup, server):
    assert server.manage("POST", "/models", url="../tiny.mar").status_code == 400
    assert server.manage("POST", "/models", url="missing.mar").status_code == 404
    registered = server.manage("POST", "/models", url="tiny-v2.mar")
    assert registered.status_code == 200, registered.text
    assert server.manage("POST", "/models", url="tiny-v2.mar").status_code == 409
    versions = server.manage("GET", "/models/tiny/all").json()
    assert [(v["modelVersion"], v["isDefault"]) for v in versions] == [("1.0", True), ("2.0", False)]
    assert _served(server, "/predictions/tiny/2.0") == pytest.approx(setup["expected"]["v2"], abs=1e-6)
    assert _served(server, "/predictions/tiny") == pytest.approx(setup["expected"]["old"], abs=1e-6)

    assert server.manage("PUT", "/models/tiny/2.0/set-default").status_code == 200
    assert _served(server, "/predictions/tiny") == pytest.approx(setup["expected"]["v2"], abs=1e-6)
    assert server.manage("DELETE", "/models/tiny/2.0").status_code == 409  # the default, with 1.0 beside it
    assert server.manage("PUT", "/models/tiny/1.0/set-default").status_code == 200
    assert server.manage("DELETE", "/models/tiny/2.0").status_code == 200
    gone = [server.post("/predictions/tiny/2.0", REQUESTS[0]).status_code for _ in range(6)]
    assert gone == [404] * 6
    assert _served(server, "/predictions/tiny") == pytest.approx(setup["expected"]["old"], abs=1e-6)


def test_both_processes_listen_on_the_grpc_port_and_take_its_connections(setup, server):
    """The processes share the one gRPC port (SO_REUSEPORT): 16 clients, each on a connection of
    its own, are all scored, and spread over both processes (all on one: a chance of 2 in 65,536)."""
    request = REQUESTS[0]
    expected = setup["expected"]["old"][: len(request["items"])]  # the first request's scores come first
    client = ScoringClient.from_archive("tiny", setup["store"] / "tiny.mar", rest_url=server.url, token=server.key)
    arrays = client.tensors(request["items"])
    client.close()
    listening = _grpc_owners(server, psutil.CONN_LISTEN)
    assert len(listening) == 2, listening
    own_connection = [("grpc.use_local_subchannel_pool", 1)]  # else channels to one target share one
    clients = [triton_grpc.InferenceServerClient(server.grpc_target, channel_args=own_connection) for _ in range(16)]
    try:
        for grpc_client in clients:
            inputs = []
            for name, array in arrays.items():
                tensor = triton_grpc.InferInput(name, list(array.shape), "FP32" if array.dtype == np.float32 else "INT64")
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            result = grpc_client.infer("tiny", inputs, headers={"authorization": f"Bearer {server.key}"})
            assert result.as_numpy("scores").tolist() == pytest.approx(expected, abs=1e-6)
        assert _grpc_owners(server, psutil.CONN_ESTABLISHED) == listening
    finally:
        for grpc_client in clients:
            grpc_client.close()


def test_a_stopped_server_leaves_nothing_behind(server):
    """Runs last of the server's tests (it stops it). Two processes under uvicorn's supervisor."""
    stop_leaving_nothing(server)


def _grpc_owners(server: AsgiServer, status: str) -> set[int]:
    """The processes holding sockets of ``status`` on the server's gRPC port."""
    return {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == server.grpc_port
            and c.status == status and c.pid is not None}
