"""The in-process ceiling: the same artifact, loaded as the worker loads it, driven without a server.

``ScoringService.handle`` is timed on exactly what a worker does per TorchServe batch (decode k
bodies, coalesce, forward, split, encode), at the batch sizes the server formed, on the same
number of intra-op threads, with the loaded objects frozen out of the garbage collector's reach
as in the worker. ``frame_read_us_per_request`` times a worker's reading of the frontend's
messages, TorchServe's reader against the handler's.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import socket
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from ts.protocol import otf_message_handler

from benchmarks.traffic import Traffic
from handlers.loading import load_archive
from handlers.runtime.batching import coalesce
from handlers.runtime.archive import Archive
from handlers.runtime.service import ScoringService
from handlers.torchserve_internals import FramedRequest, FrameReader, inference_message

_UNDECODED = "TS_DECODE_INPUT_REQUEST"  # TorchServe's switch for decoding bodies (decode_input_request)


def ceiling_items_per_s(
    service: ScoringService,
    traffic: Traffic,
    requests_per_batch: int,
    min_time_s: float = 1.0,
    repeats: int = 3,
) -> float:
    """Items/s of ``service.handle`` over batches of ``requests_per_batch`` requests from
    ``traffic``: the best of ``repeats`` timings, since a shared machine only ever slows it down."""
    k, n = max(1, requests_per_batch), len(traffic.bodies)
    starts = range(0, n, k)
    batches = [[traffic.payload((s + j) % n) for j in range(k)] for s in starts]
    items_per_batch = [sum(traffic.items[(s + j) % n] for j in range(k)) for s in starts]
    for batch in batches:  # warm-up: first-call allocations, and the table pages this traffic touches
        service.handle(batch)
    best = 0.0
    for _ in range(repeats):
        items, calls = 0, 0
        started = time.perf_counter()
        while time.perf_counter() - started < min_time_s or calls < 5:
            b = calls % len(batches)
            service.handle(batches[b])
            items += items_per_batch[b]
            calls += 1
        best = max(best, items / (time.perf_counter() - started))
    return best


def forward_us_per_item(
    service: ScoringService, traffic: Traffic, requests_per_batch: int, min_time_s: float = 1.0
) -> float:
    """The model's forward alone (no decoding, coalescing or encoding), in CPU microseconds per
    item (process time: comparable with a worker's CPU), on the intra-op threads the worker uses
    for that many items, over one batch of the traffic's first ``requests_per_batch`` requests:
    the best of three."""
    decoded = [service.decoder.decode(traffic.payload(i % len(traffic.bodies))) for i in range(requests_per_batch)]
    batch = coalesce([d.inputs for d in decoded], service.schema.tags)
    items = sum(d.inputs.num_items for d in decoded)
    threads = torch.get_num_threads()
    if service.threads_for is not None:
        torch.set_num_threads(service.threads_for(items))
    best = float("inf")
    try:
        with torch.inference_mode():
            service.model(batch)
            for _ in range(3):
                calls, started, cpu = 0, time.perf_counter(), time.process_time()
                while time.perf_counter() - started < min_time_s or calls < 5:
                    service.model(batch)
                    calls += 1
                best = min(best, (time.process_time() - cpu) / (calls * items) * 1e6)
    finally:
        torch.set_num_threads(threads)
    return best


class CeilingProcess:
    """``ceiling_items_per_s`` in a child process that holds the loaded artifact.

    The benchmark itself never maps the model's files, so the workers' PSS is theirs alone: a
    compiled package keeps its mapped weights alive for the life of the process that loaded it.
    """

    def __init__(
        self, archive: Path, traffic: dict[str, Traffic], threads: int
    ) -> None:
        self._pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_load_in_child,
            initargs=(archive, traffic, threads),
        )

    def items_per_s(self, workload: str, requests_per_batch: int, min_time_s: float = 1.0) -> float:
        return self._pool.submit(_ceiling_in_child, workload, requests_per_batch, min_time_s).result()

    def forward_us_per_item(self, workload: str, requests_per_batch: int, min_time_s: float = 1.0) -> float:
        return self._pool.submit(_forward_in_child, workload, requests_per_batch, min_time_s).result()

    def close(self) -> None:
        self._pool.shutdown()

    def __enter__(self) -> "CeilingProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_child: dict = {}  # the child's loaded service and traffic


def _load_in_child(archive: Path, traffic: dict[str, Traffic], threads: int) -> None:
    torch.set_num_threads(threads)  # as the worker runs
    _child["archive"] = Archive.open(archive)  # a .mar's files, unpacked for the child's life
    _child["service"] = load_archive(_child["archive"])
    _child["traffic"] = traffic
    # As the worker does once loaded (``torchserve_handler``): without it, the collections that a
    # batch's JSON objects trigger walk every object torch and the model made, and 30 requests of
    # 100 candidates ran at 15,000 items/s in process against 39,000 with it.
    gc.collect()
    gc.freeze()


def _forward_in_child(workload: str, requests_per_batch: int, min_time_s: float) -> float:
    return forward_us_per_item(_child["service"], _child["traffic"][workload], requests_per_batch, min_time_s)


def _ceiling_in_child(workload: str, requests_per_batch: int, min_time_s: float) -> float:
    return ceiling_items_per_s(_child["service"], _child["traffic"][workload], requests_per_batch, min_time_s)


def frame_read_us_per_request(traffic: Traffic, requests_per_message: int = 32, repeats: int = 3) -> dict[str, float]:
    """A worker's reading of the frontend's messages, in process, per request: TorchServe's
    reader (a ``recv`` per field) against the handler's ``FrameReader`` (one buffer), on the same
    inference messages of ``requests_per_message`` of the traffic's bodies each, with the HTTP
    headers ``wrk`` sends (Host, Authorization, Content-Type, Content-Length), written to a socket
    pair by another thread. The best of ``repeats`` passes over all of them."""
    n = len(traffic.bodies)

    def framed(index: int) -> FramedRequest:
        body = traffic.bodies[index % n]
        headers = {b"Host": b"127.0.0.1:8080", b"Authorization": b"Bearer 0123456789abcdef",
                   b"Content-Type": b"application/json", b"Content-Length": str(len(body)).encode()}
        return FramedRequest(f"{index:08d}-0000-4000-8000-000000000000".encode(), headers,
                             [(b"body", b"application/json", body)])

    messages = [inference_message([framed(start + j) for j in range(requests_per_message)])
                for start in range(0, n, requests_per_message)]
    stream = b"".join(messages)
    readers: dict[str, Callable[[socket.socket], Callable[[], object]]] = {
        "torchserve": lambda connection: functools.partial(otf_message_handler.retrieve_msg, connection),
        "buffered": lambda connection: FrameReader(connection).message,  # one reader per socket, as in a worker
    }
    best = dict.fromkeys(readers, float("inf"))
    undecoded = os.environ.get(_UNDECODED)
    os.environ[_UNDECODED] = "false"  # bodies as the project's config hands them over: not JSON-decoded
    try:
        for _ in range(repeats):
            for name, reader_of in readers.items():
                ours, theirs = socket.socketpair()
                writer = threading.Thread(target=theirs.sendall, args=(stream,))
                writer.start()
                read = reader_of(ours)
                started = time.perf_counter()
                for _ in messages:
                    read()
                elapsed = time.perf_counter() - started
                writer.join()
                ours.close()
                theirs.close()
                best[name] = min(best[name], elapsed / (len(messages) * requests_per_message) * 1e6)
    finally:
        if undecoded is None:
            del os.environ[_UNDECODED]
        else:
            os.environ[_UNDECODED] = undecoded
    return best
