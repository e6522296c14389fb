"""A small aiohttp server on a thread of the test process, for the load generators' tests."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Awaitable, Callable, Iterator

import pytest
from aiohttp import web

Answer = Callable[[web.Request], Awaitable[web.Response]]


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], str]]:
    """``serve(answer)``: the URL of a server answering each POST to it with ``answer(request)``;
    stopped with the test."""
    stops: list[Callable[[], None]] = []

    def start(answer: Answer) -> str:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        loop = asyncio.new_event_loop()
        started = threading.Event()

        async def serve_on() -> web.AppRunner:
            app = web.Application()
            app.router.add_post("/p", answer)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            return runner

        def run() -> None:
            asyncio.set_event_loop(loop)
            runner = loop.run_until_complete(serve_on())
            started.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert started.wait(10)

        def stop() -> None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)

        stops.append(stop)
        return f"http://127.0.0.1:{port}/p"

    yield start
    for stop in stops:
        stop()
