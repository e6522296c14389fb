"""The load generator: a lean asyncio + aiohttp client, to 127.0.0.1 only.

* closed loop: ``concurrency`` senders, each sending its next request when the last one returns;
* open loop: arrivals at a Poisson ``rate``; each request's latency counts from its *scheduled*
  send time, so a slow server cannot slow the arrivals down and hide its queueing (coordinated
  omission). Arrivals beyond ``max_in_flight`` are counted as ``client_overload``, not sent late.

Both are bounded by time and by count. The client's own CPU use (process time / wall time, in
cores) is reported so that a saturated client is visible in the results.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections import Counter
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from benchmarks.traffic import Traffic
from handlers.runtime.wire.kserve_v2 import BINARY, HEADER_LENGTH

PERCENTILES = (50, 90, 99, 99.9)


@dataclasses.dataclass(frozen=True)
class LoadResult:
    mode: str  # "closed" or "open"
    level: float  # concurrency (closed) or offered requests/s (open)
    wall_s: float
    requests: int
    items: int  # items answered with 200
    statuses: dict[str, int]  # "200": n, "400": n, "client_overload": n, "connection_error": n
    latency_ms: dict[str, float]  # "p50", "p90", "p99", "p99.9", "mean" over 200s
    client_cpu_cores: float

    @property
    def requests_per_s(self) -> float:
        return self.statuses.get("200", 0) / self.wall_s

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "requests_per_s": self.requests_per_s,
            "items_per_s": self.items_per_s,
        }


class _Recorder:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.statuses: Counter[str] = Counter()
        self.items = 0

    def result(self, mode: str, level: float, wall_s: float, cpu_s: float) -> LoadResult:
        ms = np.asarray(self.latencies) * 1000
        latency = {f"p{p:g}": float(np.percentile(ms, p)) for p in PERCENTILES} if len(ms) else {}
        if len(ms):
            latency["mean"] = float(ms.mean())
        return LoadResult(
            mode=mode,
            level=level,
            wall_s=wall_s,
            requests=sum(self.statuses.values()),
            items=self.items,
            statuses=dict(self.statuses),
            latency_ms=latency,
            client_cpu_cores=cpu_s / wall_s,
        )


def run_closed_loop(
    url: str, headers: dict, traffic: Traffic, concurrency: int, duration_s: float, max_requests: int
) -> LoadResult:
    return asyncio.run(_closed(url, headers, traffic, concurrency, duration_s, max_requests))


def run_open_loop(
    url: str,
    headers: dict,
    traffic: Traffic,
    rate: float,
    duration_s: float,
    max_in_flight: int = 1024,
    seed: int = 0,
) -> LoadResult:
    return asyncio.run(_open(url, headers, traffic, rate, duration_s, max_in_flight, seed))


def _check_loopback(url: str) -> None:
    host = urlsplit(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the benchmark only sends to loopback, not {host!r}")


async def _send(
    session: aiohttp.ClientSession, url: str, traffic: Traffic, i: int, start: float, rec: _Recorder
) -> None:
    body, items = traffic.bodies[i], traffic.items[i]
    headers = None
    if traffic.header_lengths is not None:  # KServe v2 binary tensors
        headers = {HEADER_LENGTH: str(traffic.header_lengths[i]), "Content-Type": BINARY}
    try:
        async with session.post(url, data=body, headers=headers) as response:
            await response.read()
            status = str(response.status)
    except aiohttp.ClientError:
        status = "connection_error"
    rec.statuses[status] += 1
    if status == "200":
        rec.latencies.append(time.perf_counter() - start)
        rec.items += items


def _session(headers: dict, limit: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    return aiohttp.ClientSession(
        connector=connector,
        headers={"Content-Type": "application/json", **headers},
        timeout=aiohttp.ClientTimeout(total=120),
    )


async def _closed(
    url: str, headers: dict, traffic: Traffic, concurrency: int, duration_s: float, max_requests: int
) -> LoadResult:
    _check_loopback(url)
    rec = _Recorder()
    order = itertools.cycle(range(len(traffic.bodies)))
    sent = itertools.count()
    async with _session(headers, concurrency) as session:
        cpu0, t0 = time.process_time(), time.perf_counter()
        deadline = t0 + duration_s

        async def sender() -> None:
            while time.perf_counter() < deadline and next(sent) < max_requests:
                await _send(session, url, traffic, next(order), time.perf_counter(), rec)

        await asyncio.gather(*(sender() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        return rec.result("closed", concurrency, wall, time.process_time() - cpu0)


async def _open(
    url: str,
    headers: dict,
    traffic: Traffic,
    rate: float,
    duration_s: float,
    max_in_flight: int,
    seed: int,
) -> LoadResult:
    _check_loopback(url)
    rec = _Recorder()
    rng = np.random.default_rng(seed)
    count = int(rate * duration_s)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count))
    in_flight: set[asyncio.Task] = set()
    async with _session(headers, max_in_flight) as session:
        cpu0, t0 = time.process_time(), time.perf_counter()
        for k, offset in enumerate(arrivals):
            scheduled = t0 + offset
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(in_flight) >= max_in_flight:
                rec.statuses["client_overload"] += 1
                continue
            i = k % len(traffic.bodies)
            task = asyncio.create_task(_send(session, url, traffic, i, scheduled, rec))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.gather(*in_flight)
        wall = time.perf_counter() - t0
        return rec.result("open", rate, wall, time.process_time() - cpu0)


def run_closed_loop_grpc(
    target: str,
    metadata: list[tuple[str, str]],
    model: str,
    traffic: Traffic,
    concurrency: int,
    duration_s: float,
    max_requests: int,
) -> LoadResult:
    """Closed loop over TorchServe's gRPC inference API: each body (and, for binary bodies, its
    header length) in ``PredictionsRequest.input``."""
    _check_loopback(f"grpc://{target}")
    return asyncio.run(_closed_grpc(target, metadata, model, traffic, concurrency, duration_s, max_requests))


async def _closed_grpc(
    target: str,
    metadata: list[tuple[str, str]],
    model: str,
    traffic: Traffic,
    concurrency: int,
    duration_s: float,
    max_requests: int,
) -> LoadResult:
    import grpc

    from archive_tools.grpc_inference import inference_stub, messages

    request_type = messages().PredictionsRequest
    requests = []
    for i, body in enumerate(traffic.bodies):
        inputs = {"body": body}
        if traffic.header_lengths is not None:
            inputs[HEADER_LENGTH] = str(traffic.header_lengths[i]).encode()
        requests.append(request_type(model_name=model, input=inputs))
    rec = _Recorder()
    order = itertools.cycle(range(len(requests)))
    sent = itertools.count()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_stub(channel)
        cpu0, t0 = time.process_time(), time.perf_counter()
        deadline = t0 + duration_s

        async def sender() -> None:
            while time.perf_counter() < deadline and next(sent) < max_requests:
                i = next(order)
                start = time.perf_counter()
                try:
                    await stub.Predictions(requests[i], metadata=metadata, timeout=120)
                    status = "200"
                except grpc.aio.AioRpcError as error:
                    status = f"grpc_{error.code().name.lower()}"
                rec.statuses[status] += 1
                if status == "200":
                    rec.latencies.append(time.perf_counter() - start)
                    rec.items += traffic.items[i]

        await asyncio.gather(*(sender() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        return rec.result("closed", concurrency, wall, time.process_time() - cpu0)
