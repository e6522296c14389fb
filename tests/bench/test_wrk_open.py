"""wrk's open loop (``benchmarks.wrk_open``) against a small aiohttp server in the test process,
whose own record of what arrived, and when (the same clock: ``time.perf_counter``), is the
reference."""

import asyncio
import bisect
import collections
import time

import numpy as np
import pytest
from aiohttp import web

from benchmarks.traffic import Traffic
from benchmarks.wrk_open import WrkBackgroundLoad, connections_for, run_wrk_open

SLOW_S = 0.03
SHED = b'{"shed": 1}'
TRAFFIC = Traffic(bodies=[b'{"a": 1}', b'{"a": 2}', b'{"a": 3}', SHED], items=[2, 2, 2, 2])


@pytest.fixture
def shedding(serve):
    """``(url, received)``: 200 at once, but 503 ``SLOW_S`` late to the ``SHED`` body;
    ``received``: (arrival time, body, headers) of each request."""
    received: list[tuple[float, bytes, dict]] = []

    async def answer(request: web.Request) -> web.Response:
        body = await request.read()
        received.append((time.perf_counter(), body, dict(request.headers)))
        if body == SHED:
            await asyncio.sleep(SLOW_S)
            return web.Response(status=503)
        return web.Response(body=b"{}")

    return serve(answer), received


def test_the_paced_loop_sends_poisson_arrivals_at_the_rate_and_counts_answers_by_status(shedding):
    url, received = shedding
    result = run_wrk_open(url, {"Authorization": "Bearer token"}, TRAFFIC, rate=300, duration_s=1)
    arrivals = np.array([at for at, _, _ in received])
    gaps = np.diff(arrivals)
    # ~300 arrivals in the second: 4 standard deviations (sqrt(300) = 17) either way, by the
    # server's clock and by wrk's (arrivals sent late are still sent); random gaps, not even ones
    # (exponential: their deviation is their mean; a stall of the machine only adds to it)
    assert 230 <= len(arrivals) / (arrivals[-1] - arrivals[0]) <= 370
    assert 230 <= result.achieved_rps <= 370
    assert gaps.std() / gaps.mean() >= 0.7
    # every answer counted by its status; in flight when wrk stopped: one a connection at most
    shed = sum(body == SHED for _, body, _ in received)
    assert set(result.statuses) == {"200", "503"}
    assert result.statuses["503"] <= shed <= result.statuses["503"] + connections_for(300)
    assert result.requests <= len(received) <= result.requests + connections_for(300)
    assert result.items == 2 * result.statuses["200"]
    assert collections.Counter(body for _, body, _ in received).keys() == set(TRAFFIC.bodies)
    assert all(headers["Authorization"] == "Bearer token" for _, _, headers in received)
    # wrk's histogram of every answer: a quarter of them SLOW_S late or more
    assert result.latency_ms["p90"] >= SLOW_S * 1000
    assert result.client == "wrk" and result.client_threads == 1 and 0 < result.client_cpu_cores < 0.5
    # when each 503 came: SLOW_S or more after its shed body arrived
    shed_at = sorted(at for at, body, _ in received if body == SHED)
    assert len(result.refused) == result.statuses["503"] and {status for _, status in result.refused} == {503}
    for answered, _ in result.refused:
        arrived = shed_at[bisect.bisect_right(shed_at, answered - SLOW_S) - 1]
        assert SLOW_S <= answered - arrived < SLOW_S + 0.1


def test_a_timeline_pairs_each_send_with_its_answer(shedding):
    """A thread a connection: each request's status and latency are its own (every one of the shed
    body's 503s took SLOW_S or more), and the server saw it between its send and its answer."""
    url, received = shedding
    before = time.perf_counter()
    with WrkBackgroundLoad(url, {}, TRAFFIC, rate=200, timeline=True) as load:
        time.sleep(0.5)
    result = load.result
    assert result is not None and len(result.events) == result.requests > 50
    assert collections.Counter(status for _, _, status in result.events) == result.statuses
    shed = [answered - sent for sent, answered, status in result.events if status == "503"]
    assert shed and min(shed) >= SLOW_S and result.rejected_latency_ms["p50"] >= SLOW_S * 1000
    assert "p99" in result.latency_ms  # of the 200s
    arrivals = sorted(at for at, _, _ in received)
    for sent, answered, _ in result.events:
        assert before < sent <= answered
        found = bisect.bisect_left(arrivals, sent)
        assert found < len(arrivals) and arrivals[found] <= answered


def test_a_rate_the_server_cannot_keep_shows_as_late_sends_counted_from_their_schedule(serve):
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(0.25)
        return web.Response(body=b"{}")

    # 10 connections (100/s x 100 ms), each answered after 250 ms: 40 requests/s at most
    assert connections_for(100, timeline=True) == 10
    result = run_wrk_open(serve(answer), {}, TRAFFIC, rate=100, duration_s=1, timeline=True)
    assert result.achieved_rps < 60 and result.late_sends > 10
    # the k-th arrival (due at k/100 s) goes out near k/40 s: its latency counts from k/100 s
    assert result.latency_ms["p90"] > 300


def test_refuses_what_it_cannot_send():
    with pytest.raises(ValueError, match="only sends to loopback"):
        run_wrk_open("http://example.com/p", {}, TRAFFIC, rate=10, duration_s=1)
    with pytest.raises(ValueError, match="rate must be positive"):
        run_wrk_open("http://127.0.0.1:1/p", {}, TRAFFIC, rate=0, duration_s=1)
