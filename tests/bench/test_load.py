"""The load generator against a small aiohttp server on a thread of the test process."""

import collections
import gc
import pickle
import subprocess
import sys

import pytest
from aiohttp import web

from benchmarks.load import BackgroundLoad, run_closed_loop, run_open_loop
from benchmarks.traffic import Traffic
from benchmarks.wrk import run_wrk
from handlers.runtime.wire.v2_headers import HEADER_LENGTH


@pytest.fixture
def server(serve, received):
    """``(url, freeze counts seen by the first requests)``: a server answering every POST with 200
    (and keeping each request's body and headers in ``received``). A count walks every frozen
    object (half a million in a test process: 25 ms with the GIL held), so only the first two."""
    seen: list[int] = []

    async def answer(request: web.Request) -> web.Response:
        received.append((await request.read(), dict(request.headers)))
        if len(seen) < 2:
            seen.append(gc.get_freeze_count())
        return web.Response(body=b"{}")

    return serve(answer), seen


@pytest.fixture
def received():
    return []


TRAFFIC = Traffic(bodies=[b'{"a": 1}', b'{"a": 2}'], items=[1, 3])


def test_open_loop_answers_and_keeps_the_collector_off_what_was_alive_before(server):
    url, seen = server
    frozen = gc.get_freeze_count()  # this test process froze what its collection imported
    result = run_open_loop(url, {}, TRAFFIC, rate=200, duration_s=0.5)
    assert result.statuses == {"200": result.requests} and result.requests >= 50
    assert result.items == sum(TRAFFIC.items[k % 2] for k in range(result.requests))
    assert min(seen) > 1000  # torch's objects among them, frozen while the loop ran
    assert gc.get_freeze_count() >= frozen > 0  # the process's own freeze kept


def test_a_process_that_froze_nothing_has_it_all_back_in_the_collectors_reach():
    program = (
        "import gc; from benchmarks.load import collector_frozen\n"
        "with collector_frozen():\n    during = gc.get_freeze_count()\n"
        "print(during > 1000, gc.get_freeze_count())"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["True", "0"], done.stderr


def test_closed_loop_counts_requests_and_items(server):
    url, seen = server
    result = run_closed_loop(url, {}, TRAFFIC, concurrency=4, duration_s=10.0, max_requests=40)
    assert result.requests == 40 and result.statuses == {"200": 40}
    assert result.items == 20 * (1 + 3)
    assert min(seen) > 1000 and gc.get_freeze_count() > 0  # the process's own freeze kept


def test_the_background_loads_process_imports_no_torch():
    """``BackgroundLoad`` spawns a process that imports ``benchmarks.load`` and unpickles what it
    is sent: with torch (and TorchRec, through ``benchmarks.traffic``) that was 4 s of CPU for each
    load, on the machine it measures."""
    sent = pickle.dumps(BackgroundLoad("http://127.0.0.1:1/p", {}, TRAFFIC, rate=10).arguments)
    listing = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print(sorted({m.split('.')[0] for m in sys.modules}))"
    imported = subprocess.run([sys.executable, "-c", listing], input=sent, capture_output=True, check=True).stdout.decode()
    assert "'torch'" not in imported and "'benchmarks'" in imported, imported


def test_only_loopback_is_loaded():
    with pytest.raises(ValueError, match="only sends to loopback"):
        run_open_loop("http://example.com/p", {}, TRAFFIC, rate=10, duration_s=0.1)


def test_wrk_sends_the_bodies_in_turn_with_their_headers_and_counts_what_was_answered(server, received):
    """Binary bodies too (their JSON header length in its header); the server got every request
    wrk counted, and at most one more per connection (in flight when wrk stopped)."""
    url, _ = server
    traffic = Traffic(bodies=[b'{"a": 1}', b"\x00\n{bin", b'{"c": 3}'], items=[2, 2, 2], header_lengths=[8, 3, 8])
    result = run_wrk(url, {"Authorization": "Bearer token"}, traffic, concurrency=2, duration_s=1)
    assert result.client == "wrk" and result.statuses == {"200": result.requests} and result.requests > 20
    assert result.requests <= len(received) <= result.requests + 2
    assert result.items == 2 * result.requests
    assert set(result.latency_ms) == {"p50", "p90", "p99", "p99.9", "mean"} and 0 < result.latency_ms["p50"]
    assert 0 < result.client_cpu_cores < 1 and not result.client_saturated
    assert result.client_summary() == {"client": "wrk", "cpu_cores": round(result.client_cpu_cores, 3), "saturated": False}
    sent = collections.Counter(body for body, _ in received)
    assert set(sent) == set(traffic.bodies) and max(sent.values()) - min(sent.values()) <= 1  # in turn
    for body, headers in received:
        assert headers["Authorization"] == "Bearer token"
        assert headers[HEADER_LENGTH] == str(traffic.header_lengths[traffic.bodies.index(body)])
        assert headers["Content-Type"] == "application/octet-stream"
