"""The project's TorchServe plugin, loaded by a real TorchServe from ``config/config.properties``:
the management API it takes over (locked model store, 409 before unpacking, ``initial_workers=0``,
drained scale-down), admission control, the hung-worker watchdog and ``/ping``."""

from __future__ import annotations

import os
import resource
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import torch

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.local_server import LocalTorchServe
from benchmarks.load import BackgroundLoad, run_closed_loop
from benchmarks.traffic import TrafficModel
from benchmarks.worker_cpu import worker_pids
from handlers.modeling.registry import load_spec
from tests.conftest import TINY_SPEC
from tests.helpers import QUANTIZATION_TOLERANCE, float_scores, items_request

pytestmark = pytest.mark.integration

ONE = items_request(load_spec(TINY_SPEC), 1, seed=3)
START_NICE = 10  # StartPriority.START_NICE in the plugin


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("plugin") / "model_store"
    build_archive(
        TINY_SPEC, checkpoint=None, seed=0, name="tiny", version="1.0", model_store=store,
        serving=ServingConfig(batch_size=8, max_batch_delay_ms=5),
    )
    return store


@pytest.fixture(scope="module")
def server(store):
    with LocalTorchServe(model_store=store) as server:
        assert server.register("tiny.mar").status_code == 200
        yield server


@pytest.fixture(scope="module")
def expected(tiny_spec, tiny_float_model) -> torch.Tensor:
    """ONE's scores from the float model the archive was built from (seed 0)."""
    return float_scores(tiny_float_model, tiny_spec, ONE)


def _assert_scored(response: requests.Response, expected: torch.Tensor) -> None:
    assert response.status_code == 200, response.text
    torch.testing.assert_close(torch.tensor(response.json()["scores"]), expected, atol=QUANTIZATION_TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def traffic(tiny_spec):
    return TrafficModel(items_per_request=1).generate(tiny_spec, 64, seed=1)


def _ready_pids(server: LocalTorchServe, name: str) -> list[int]:
    described = server.management("GET", f"/models/{name}").json()[0]
    return [w["pid"] for w in described["workers"] if w["status"] == "READY"]


def _until(condition, timeout_s: float) -> float:
    """Seconds until ``condition()`` held; fails the test past ``timeout_s``."""
    started = time.perf_counter()
    while not condition():
        assert time.perf_counter() - started < timeout_s, f"not within {timeout_s}s"
        time.sleep(0.05)
    return time.perf_counter() - started


@pytest.mark.parametrize("header", ["describe", "Describe"])
def test_an_inference_request_cannot_pass_for_a_management_describe_call(server, header, expected):
    """The handler answers a batch led by a describe call with its description: from a client
    that would fail the whole batch. Such a request is refused alone; the others score."""
    import json

    body = json.dumps(ONE)
    with ThreadPoolExecutor(4) as pool:
        plain = [pool.submit(server.predict, "tiny", ONE) for _ in range(3)]
        spoofed = server.call("inference", "POST", f"{server.inference_url}/predictions/tiny", data=body,
                              headers={"Content-Type": "application/json", header: "True"}, timeout=30)
    assert spoofed.status_code == 400, spoofed.text
    assert "describe: a header of the management API's calls" in spoofed.json()["message"]
    for answer in plain:
        _assert_scored(answer.result(), expected)


@pytest.mark.parametrize(
    "url", ["/abs/path/tiny.mar", "file:///tmp/tiny.mar", "https://example.invalid/model.mar", "../tiny.mar", "a/tiny.mar"]
)
def test_register_takes_only_names_inside_the_model_store(server, url):
    response = server.register(url)
    assert response.status_code == 400, response.text
    message = response.json()["message"]
    assert message.startswith("url:") and "directly inside the model store" in message


def test_the_frontend_unpacks_archives_in_the_servers_own_folder(server):
    unpacked = list((server.workdir / "tmp" / "models").glob("*/MAR-INF/MANIFEST.json"))
    assert len(unpacked) == 1  # removed with the folder when the server stops


def test_register_of_a_missing_archive_is_a_404_naming_it(server):
    response = server.register("nothing.mar")
    assert response.status_code == 404 and "no 'nothing.mar' in the model store" in response.json()["message"]


def test_a_registered_version_is_refused_with_409_leaving_nothing_behind(server, store, expected):
    before = sorted(p.name for p in store.iterdir())
    response = server.register("tiny.mar")
    assert response.status_code == 409, response.text
    assert "1.0 is already registered for model tiny" in response.json()["message"]
    assert sorted(p.name for p in store.iterdir()) == before
    _assert_scored(server.predict("tiny", ONE), expected)


def test_register_refuses_a_body_and_bad_numbers(server):
    body = server.management("POST", "/models", json={"url": "tiny.mar"})
    assert body.status_code == 400 and "query string" in body.json()["message"]
    workers = server.register("tiny.mar", model_name="neg", initial_workers=-1)
    assert workers.status_code == 400 and "initial_workers" in workers.json()["message"]
    guard = server.register("tiny.mar", model_name="neg", max_queue_wait_ms="soon")
    assert guard.status_code == 400 and "max_queue_wait_ms" in guard.json()["message"]


def test_initial_workers_zero_is_honoured(server, expected):
    assert server.register("tiny.mar", model_name="idle", initial_workers=0).status_code == 200
    try:
        assert server.management("GET", "/models/idle").json()[0]["workers"] == []
        assert server.predict("idle", ONE).status_code == 503
        scaled = server.management("PUT", "/models/idle", params={"min_worker": 1, "synchronous": "true"})
        assert scaled.status_code == 200, scaled.text
        _assert_scored(server.predict("idle", ONE), expected)
    finally:
        server.management("DELETE", "/models/idle")


def _thread_nices(pid: int) -> set[int]:
    """The nice of each thread of process ``pid`` (empty once it is gone)."""
    try:
        return {os.getpriority(os.PRIO_PROCESS, thread.id) for thread in psutil.Process(pid).threads()}
    except (psutil.NoSuchProcess, ProcessLookupError):
        return set()


def test_a_starting_worker_runs_below_serving_priority_until_loaded(server, expected):
    """A worker scaling up starts at nice 10 (Python, imports, load), then serves at nice 0 on
    every thread; where the server may not raise it back, it never lowers it and says so."""
    if not _may_raise_priority():
        assert "new workers start at serving's CPU priority" in server.log_tail()
        return
    assert server.register("tiny.mar", model_name="nice", initial_workers=0).status_code == 200
    try:
        group = server.process.pid
        before = set(worker_pids(group))
        assert server.management("PUT", "/models/nice", params={"min_worker": 1}).status_code == 202
        seen: dict[int, set[int]] = {}

        def ready() -> bool:
            for pid in set(worker_pids(group)) - before:
                seen.setdefault(pid, set()).update(_thread_nices(pid))
            return len(_ready_pids(server, "nice")) == 1

        _until(ready, timeout_s=120)
        (pid,) = _ready_pids(server, "nice")
        assert START_NICE in seen[pid], seen  # while it started
        _until(lambda: _thread_nices(pid) == {0}, timeout_s=2)  # every thread, once loaded
        _assert_scored(server.predict("nice", ONE), expected)
    finally:
        server.management("DELETE", "/models/nice")


def _may_raise_priority() -> bool:
    """CAP_SYS_NICE, or an RLIMIT_NICE of 20: what the server (our child) needs to raise a worker back."""
    status = Path("/proc/self/status").read_text()
    capabilities = int(status.split("CapEff:")[1].split()[0], 16)
    return bool(capabilities >> 23 & 1) or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def test_describe_shows_the_admission_queue(server):
    admission = server.management("GET", "/models/tiny").json()[0]["admission"]
    assert set(admission) >= {"queued", "target_ms", "batch_ms", "request_ms", "hang_after_ms", "shed_overloaded"}
    assert admission["hang_after_ms"] >= 2000


def test_scale_down_under_load_loses_no_request(server, traffic):
    """TorchServe alone interrupts a worker mid-batch (500 "Worker died.") or drops the batch it is
    collecting; the plugin drains it first. (A model of its own, with a wait target admission
    control never reaches: the test suite runs beside other tests, and a new worker's start on a
    busy machine must not be answered with the 503s that shed load.)"""
    assert server.register("tiny.mar", model_name="drained", max_queue_wait_ms=60_000).status_code == 200
    url = f"{server.inference_url}/predictions/drained"
    try:
        with BackgroundLoad(url, server.auth("inference"), traffic, rate=150) as load:
            for _ in range(3):
                for workers in (2, 1):
                    scaled = server.management(
                        "PUT", "/models/drained", params={"min_worker": workers, "synchronous": "true"}
                    )
                    assert scaled.status_code == 200, scaled.text
                    time.sleep(0.3)
        result = load.result
        assert result.requests > 100
        assert result.statuses == {"200": result.requests}, result.statuses
        assert len(_ready_pids(server, "drained")) == 1
    finally:
        server.management("DELETE", "/models/drained")


def test_overload_is_refused_at_once_with_retry_after(server, traffic):
    """A wait target of 1 ms with 32 senders: requests that would wait longer are refused up front
    with a 503 that says why, the others are served."""
    assert server.register("tiny.mar", model_name="tight", max_queue_wait_ms=1).status_code == 200
    try:
        url = f"{server.inference_url}/predictions/tight"
        run_closed_loop(url, server.auth("inference"), traffic, 4, 1.0, 10**6)  # measured batch time
        shed_before = server.management("GET", "/models/tight").json()[0]["admission"]["shed_overloaded"]
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda body: server.predict("tight", body), traffic.bodies * 8))
        statuses = {r.status_code for r in answers}
        assert statuses == {200, 503}, statuses
        refused = next(r for r in answers if r.status_code == 503)
        assert refused.json()["type"] == "ServiceUnavailable" and "max_queue_wait_ms" in refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        admission = server.management("GET", "/models/tight").json()[0]["admission"]
        assert admission["shed_overloaded"] - shed_before == sum(r.status_code == 503 for r in answers)
    finally:
        server.management("DELETE", "/models/tight")


def test_a_hung_worker_is_answered_for_reported_and_replaced(server, tiny_spec, expected):
    assert server.register("tiny.mar", model_name="hangs").status_code == 200
    victim = _ready_pids(server, "hangs")[0]
    try:
        os.kill(victim, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(server.predict, "hangs", ONE)
            detect_s = _until(
                lambda: requests.get(f"{server.inference_url}/ping", headers=server.auth("inference"), timeout=10)
                .status_code == 503,
                timeout_s=10,
            )
            answer = in_flight.result(timeout=30)
        assert detect_s < 5
        assert answer.status_code == 503 and "stopped answering" in answer.json()["message"], answer.text
        _until(lambda: _ready_pids(server, "hangs") not in ([], [victim]), timeout_s=60)
        _assert_scored(server.predict("hangs", ONE), expected)
        ping = requests.get(f"{server.inference_url}/ping", headers=server.auth("inference"), timeout=10)
        assert ping.status_code == 200, ping.text
        assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    finally:
        if psutil.pid_exists(victim):
            os.kill(victim, signal.SIGCONT)
        server.management("DELETE", "/models/hangs")


def test_a_worker_killed_while_it_collects_a_batch_answers_the_requests_it_took(server):
    """A worker that dies while it waits for more requests to fill a batch: TorchServe alone drops
    the requests it had taken, answered by nobody (their clients wait for their own timeouts); the
    plugin's queue ends the batch instead, and TorchServe answers it as a dead worker's. (Its
    replacement is test_serving's.)"""
    assert server.register("tiny.mar", model_name="dies", batch_size=8, max_batch_delay=4000).status_code == 200
    victim = _ready_pids(server, "dies")[0]
    try:
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(server.predict, "dies", ONE)
            time.sleep(1.0)  # taken by the worker, which waits up to 4 s for seven more
            os.kill(victim, signal.SIGKILL)
            answer = in_flight.result(timeout=30)
        assert answer.status_code in (500, 507) and "Worker died" in answer.text, answer.text
    finally:
        server.management("DELETE", "/models/dies")
