"""The asgi engine's management routes on a real ``--workers 2`` server (a subprocess): models
registered, versioned and unregistered by archive name in every process; the management key
alone opens them; a row delta published under load with no failed request, after which every
process serves a fresh build's scores, and rolled back; a killed process restarted by uvicorn's
supervisor with only the requests it held failing."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import requests

from archive_tools.build import build_archive
from archive_tools.delta import DeltaSource, make_delta
from archive_tools.local_asgi import LocalAsgiServer
from archive_tools.model_config import ServingConfig
from benchmarks.load import BackgroundLoad
from benchmarks.traffic import TrafficModel
from handlers.runtime.artifacts import Artifact
from tests.conftest import TINY_SPEC
from tests.helpers import archive_service
from tests.integration.publishing_archives import build, checkpoints
from tests.integration.test_publishing import REQUESTS, SPEC, _scores

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("asgi-mgmt")
    base, newer = checkpoints(root)
    store = root / "model_store"
    build(base, store, "tiny", Artifact.EAGER)  # version 1.0
    build_archive(TINY_SPEC, checkpoint=None, seed=5, name="tiny", version="2.0", model_store=root / "v2",
                  serving=ServingConfig(batch_size=8, max_batch_delay_ms=5))
    shutil.move(root / "v2" / "tiny.mar", store / "tiny-v2.mar")
    fresh = build(newer, root / "fresh", "tiny", Artifact.EAGER)
    (store / "deltas").mkdir()
    make_delta(store / "tiny.mar", DeltaSource(checkpoint=newer), store / "deltas" / "tiny-1.delta", sequence=1)
    expected = {"old": _scores(archive_service(store / "tiny.mar")), "new": _scores(archive_service(fresh)),
                "v2": _scores(archive_service(store / "tiny-v2.mar"))}
    assert expected["old"] != pytest.approx(expected["new"], abs=1e-4)
    return {"store": store, "expected": expected}


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    with LocalAsgiServer(setup["store"], ["tiny.mar"], 2, tmp_path_factory.mktemp("asgi-mgmt-server")) as server:
        server.processes("tiny", 2)  # both processes serve before the tests start
        yield server


def _served(server: LocalAsgiServer, path: str) -> list[float]:
    """Every request's scores, each sent three times on new connections (to either process): the
    same answer each time."""
    answers = [[server.post(path, r) for _ in range(3)] for r in REQUESTS]
    assert all(a.status_code == 200 for sent in answers for a in sent), [a.text for sent in answers for a in sent]
    assert all(len({a.text for a in sent}) == 1 for sent in answers), [[a.text for a in sent] for sent in answers]
    return [x for sent in answers for x in sent[0].json()["scores"]]


def _state_when(server: LocalAsgiServer, done, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = server.manage("GET", "/freshness/tiny").json()
        if done(state):
            return state
        time.sleep(0.05)
    raise AssertionError(f"freshness state not reached in {timeout_s} s: {state}")


def test_management_routes_take_the_management_key_alone(server):
    inference = server.auth
    assert requests.get(f"{server.url}/models", headers=inference, timeout=10).status_code == 400
    assert requests.get(f"{server.url}/freshness/tiny", timeout=10).status_code == 400
    assert server.manage("GET", "/models").json() == {"models": [{"modelName": "tiny", "modelUrl": "tiny.mar"}]}
    predicted = requests.post(f"{server.url}/predictions/tiny", json=REQUESTS[0], headers=server.management_auth, timeout=10)
    assert predicted.status_code == 400 and predicted.json()["type"] == "InvalidKeyException"


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


def test_a_row_delta_published_under_load_reaches_every_process_and_rolls_back(setup, server):
    traffic = TrafficModel(items_per_request=1).generate(SPEC, 64, seed=1)
    with BackgroundLoad(f"{server.url}/predictions/tiny", server.auth, traffic, rate=60) as load:
        time.sleep(0.5)
        published = server.manage("POST", "/freshness/tiny", delta="tiny-1.delta")
        assert published.status_code == 200, published.text
        assert published.json()["sequence"] == 1 and not published.json()["duplicate"]
        state = _state_when(server, lambda s: s["applied_sequence"] == 1)
        time.sleep(0.3)
    assert load.result.statuses == {"200": load.result.requests}, load.result.statuses
    assert state["log_head"] == 1 and state["rows_applied"] > 0 and len(state["workers"]) == 2
    assert _served(server, "/predictions/tiny") == pytest.approx(setup["expected"]["new"], abs=1e-6)
    assert server.manage("POST", "/freshness/tiny", delta="tiny-1.delta").json()["duplicate"]

    rolled = server.manage("POST", "/freshness/tiny", rollback_to=0)
    assert rolled.status_code == 200 and rolled.json() == {"rolling_back_to": 0, "from": 1}, rolled.text
    _state_when(server, lambda s: s["applied_sequence"] == 0 and s["rolling_back_to"] is None)
    assert _served(server, "/predictions/tiny") == pytest.approx(setup["expected"]["old"], abs=1e-6)


def test_a_killed_process_is_restarted_and_only_its_requests_fail(setup, server):
    before = server.processes("tiny", 2)
    traffic = TrafficModel(items_per_request=1).generate(SPEC, 64, seed=2)
    with BackgroundLoad(f"{server.url}/predictions/tiny", server.auth, traffic, rate=60) as load:
        time.sleep(0.5)
        os.kill(before[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while (after := server.processes("tiny", 2)) and before[0] in after or before[1] not in after:
            assert time.monotonic() < deadline, f"no process in place of {before[0]}: {after}"
            time.sleep(0.25)
        time.sleep(0.5)
    statuses = dict(load.result.statuses)
    failed = statuses.pop("connection_error", 0)
    assert statuses == {"200": load.result.requests - failed}, load.result.statuses
    assert failed <= 8, load.result.statuses  # the requests the killed process held, no more
    assert _served(server, "/predictions/tiny") == pytest.approx(setup["expected"]["old"], abs=1e-6)
