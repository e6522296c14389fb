"""The load generator against a small aiohttp server on a thread of the test process."""

import asyncio
import gc
import socket
import threading

import pytest
from aiohttp import web

from benchmarks.load import run_closed_loop, run_open_loop
from benchmarks.traffic import Traffic


@pytest.fixture
def server():
    """``(url, freeze counts seen by each request)``: a server answering every POST with 200."""
    seen: list[int] = []

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        seen.append(gc.get_freeze_count())
        return web.Response(body=b"{}")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/p", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner = loop.run_until_complete(serve())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{port}/p", seen
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


TRAFFIC = Traffic(bodies=[b'{"a": 1}', b'{"a": 2}'], items=[1, 3])


def test_open_loop_answers_and_keeps_the_collector_off_what_was_alive_before(server):
    url, seen = server
    result = run_open_loop(url, {}, TRAFFIC, rate=200, duration_s=0.5)
    assert result.statuses == {"200": result.requests} and result.requests >= 50
    assert result.items == sum(TRAFFIC.items[k % 2] for k in range(result.requests))
    assert min(seen) > 1000  # torch's objects among them, frozen while the loop ran
    assert gc.get_freeze_count() == 0  # and back in the collector's reach afterwards


def test_closed_loop_counts_requests_and_items(server):
    url, seen = server
    result = run_closed_loop(url, {}, TRAFFIC, concurrency=4, duration_s=10.0, max_requests=40)
    assert result.requests == 40 and result.statuses == {"200": 40}
    assert result.items == 20 * (1 + 3)
    assert min(seen) > 1000 and gc.get_freeze_count() == 0


def test_only_loopback_is_loaded():
    with pytest.raises(ValueError, match="only sends to loopback"):
        run_open_loop("http://example.com/p", {}, TRAFFIC, rate=10, duration_s=0.1)
