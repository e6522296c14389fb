"""Whether another HTTP request can reach this process before it answers one. An HTTP/1.1
connection carries one request at a time (uvicorn runs a pipelined request only once the one
before it is answered), so when every open connection of the process has a request waiting in a
batcher, none can arrive until an answer goes out: a batch then stops waiting to fill
(``batcher.py``). Without this, each of N processes sees a 1/N share of the clients and every
batch waits out its whole delay: 32 clients over two processes never fill a batch of 32.

uvicorn's HTTP protocol (``CountedHttpTools``, given to ``uvicorn.run(http=...)``) counts the
process's open connections; the inference routes count the requests they wait on:

    with CONNECTIONS.waiting():
        response = await batcher.submit(arrival)
    CONNECTIONS.all_waiting()     # True: every open connection waits on an answer

gRPC calls are counted in neither: they share HTTP/2 connections, and one more may always come
(it joins the next batch).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HttpConnections:
    """This process's open HTTP connections, and its HTTP requests waiting in a batcher."""

    def __init__(self) -> None:
        self.open = 0
        self.waiting_requests = 0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        self.waiting_requests += 1
        try:
            yield
        finally:
            self.waiting_requests -= 1

    def all_waiting(self) -> bool:
        return 0 < self.open <= self.waiting_requests


CONNECTIONS = HttpConnections()  # the process's: one event loop serves every connection


class CountedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol (C parsing), its connections counted in ``CONNECTIONS``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        CONNECTIONS.open += 1
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        CONNECTIONS.open -= 1
        super().connection_lost(exc)
