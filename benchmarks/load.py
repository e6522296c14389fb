"""The Python load generator: a lean asyncio + aiohttp client, to 127.0.0.1 only.

* closed loop: ``concurrency`` senders, each sending its next request when the last one returns;
* open loop: arrivals at a Poisson ``rate``; each request's latency counts from its *scheduled*
  send time, so a slow server cannot slow the arrivals down and hide its queueing (coordinated
  omission). Arrivals beyond ``max_in_flight`` are counted as ``client_overload``, not sent late.

Both are bounded by time and by count. The client's own CPU use (process time / wall time, in
cores) is reported so that a saturated client is visible in the results. While a loop runs, every
object alive before it is out of the garbage collector's reach (``collector_frozen``), so that
the client's own collections do not pass for the server's latency.

``BackgroundLoad`` runs an open loop in a process of its own while the caller does something to
the server (kill a worker, scale, register), and keeps every request's (sent, answered, status).

The client costs the server it loads a share of the machine (0.57 of two cores at 3,080 requests/s):
the reliability suite's max-load search, soak, register and log phases and the freshness scenario
load with ``wrk`` instead (``benchmarks.wrk_open``, the same ``LoadResult``). This one stays where
requests in flight must not be bounded by connections (the reliability suite's disruptions and
overload, the distributed scenario's failover: wrk's loop sends late when answers slow, and fewer
requests then fail), where each body must be sent its exact share of the time or each request's
items counted (the poisoned phase's 1%, the serving scenarios' mixed workloads), and for the tests'
background loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import multiprocessing
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterator, Sequence
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from handlers.runtime.wire.v2_headers import BINARY, HEADER_LENGTH

if TYPE_CHECKING:  # not imported at run time: BackgroundLoad's process imports this module alone
    from benchmarks.traffic import Traffic

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
    rejected_latency_ms: dict[str, float] = dataclasses.field(default_factory=dict)  # over 503s
    client: str = "python"  # or "wrk" (benchmarks.wrk, benchmarks.wrk_open)
    client_threads: int = 1  # the cores the client can use: one for Python's event loop
    # open loop, wrk: requests sent benchmarks.wrk_open.LATE_S or more after their schedule (their
    # connection still waited for an answer); the Python loop counts its "client_overload" instead
    late_sends: int = 0
    # every request: (sent, answered) on the perf_counter clock, and its status (BackgroundLoad)
    events: list[tuple[float, float, str]] = dataclasses.field(default_factory=list, repr=False)
    # wrk's paced open loop: when each answer other than a 200 came (perf_counter), its status
    refused: list[tuple[float, int]] = dataclasses.field(default_factory=list, repr=False)

    @property
    def requests_per_s(self) -> float:
        return self.statuses.get("200", 0) / self.wall_s

    @property
    def achieved_rps(self) -> float:
        """Requests sent per second, whatever their answer: an open loop's rate as it was kept."""
        return self.requests / self.wall_s

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s

    @property
    def client_saturated(self) -> bool:
        """The client, not the server, may have set the pace: it used 90% of its cores or more."""
        return self.client_cpu_cores >= 0.9 * self.client_threads

    def client_summary(self) -> dict:
        """Which client ran the point, its CPU in cores and whether it was saturated."""
        return {"client": self.client, "cpu_cores": round(self.client_cpu_cores, 3), "saturated": self.client_saturated}

    def to_dict(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("events", "refused")}
        return {
            **fields,
            "requests_per_s": self.requests_per_s,
            "achieved_rps": self.achieved_rps,
            "items_per_s": self.items_per_s,
            "client_saturated": self.client_saturated,
        }


def latency_percentiles(seconds: Sequence[float] | np.ndarray) -> dict[str, float]:
    """``{"p50", "p90", "p99", "p99.9", "mean"}`` in ms of latencies in seconds; {} of none."""
    ms = np.asarray(seconds) * 1000
    if not len(ms):
        return {}
    return {**{f"p{p:g}": float(np.percentile(ms, p)) for p in PERCENTILES}, "mean": float(ms.mean())}


class _Recorder:
    def __init__(self, keep_events: bool = False) -> None:
        self.latencies: list[float] = []
        self.rejected: list[float] = []
        self.statuses: Counter[str] = Counter()
        self.items = 0
        self.events: list[tuple[float, float, str]] | None = [] if keep_events else None

    def record(self, start: float, status: str, items: int) -> None:
        end = time.perf_counter()
        self.statuses[status] += 1
        if status == "200":
            self.latencies.append(end - start)
            self.items += items
        elif status == "503":
            self.rejected.append(end - start)
        if self.events is not None:
            self.events.append((start, end, status))

    def result(self, mode: str, level: float, wall_s: float, cpu_s: float) -> LoadResult:
        return LoadResult(
            mode=mode,
            level=level,
            wall_s=wall_s,
            requests=sum(self.statuses.values()),
            items=self.items,
            statuses=dict(self.statuses),
            latency_ms=latency_percentiles(self.latencies),
            client_cpu_cores=cpu_s / wall_s,
            rejected_latency_ms=latency_percentiles(self.rejected),
            events=self.events or [],
        )


@contextlib.contextmanager
def collector_frozen() -> Iterator[None]:
    """Every object alive now moved out of the garbage collector's reach until the block ends.

    A load process holds about 240,000 objects that the collector tracks, most of them torch's
    (the traffic model imports it). Without this, a full collection walks them all every
    half minute or so, triggered by the loop's own garbage, and blocks the event loop for
    120-180 ms (measured: the loop's gaps matched the collector's gen-2 passes to the
    millisecond). Every request in flight then shows that stall as server latency.

    A process that had frozen objects before (a test process, a server) keeps them frozen, these
    with them: unfreezing is all or nothing, and would hand back what it froze for its own reasons.
    """
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


def run_closed_loop(
    url: str, headers: dict, traffic: Traffic, concurrency: int, duration_s: float, max_requests: int
) -> LoadResult:
    with collector_frozen():
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
    with collector_frozen():
        return asyncio.run(_open(url, headers, traffic, rate, duration_s, max_in_flight, seed))


class BackgroundLoad:
    """An open loop at ``rate`` in a process of its own until ``stop()``, which returns its result
    with every request's events:

        with BackgroundLoad(url, headers, traffic, rate=200) as load:
            ...                                  # act on the server
        load.result.events                       # [(sent, answered, status)]

    A process, not a thread: the caller's own work (publishing, polling, parsing answers) would
    otherwise share the GIL with the loop and delay the sending and reading that its latencies
    are timed by. Times are ``time.perf_counter`` (the system's monotonic clock), comparable with
    the caller's. ``__enter__`` returns once the loop is sending.
    """

    def __init__(self, url: str, headers: dict, traffic: Traffic, rate: float, max_s: float = 3600.0) -> None:
        context = multiprocessing.get_context("spawn")
        self._sending = context.Event()
        self._stopping = context.Event()
        self._results = context.Queue()
        sent = _Sent(traffic.bodies, traffic.items, traffic.header_lengths)  # unpickled without benchmarks.traffic
        self.arguments = (url, headers, sent, rate, max_s, 1024, 0)  # what the process is sent, pickled
        self._process = context.Process(
            target=_background,
            args=(self.arguments, self._sending, self._stopping, self._results),
            daemon=True,
        )
        self.result: LoadResult | None = None

    def __enter__(self) -> "BackgroundLoad":
        self._process.start()
        while not self._sending.wait(0.1):
            if not self._process.is_alive():
                raise RuntimeError(f"the load process exited with {self._process.exitcode} before sending")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        if self.result is None:
            self._stopping.set()
            self.result = self._results.get(timeout=300)  # before join: a full pipe blocks the child
            self._process.join(timeout=30)
        return self.result


@dataclasses.dataclass(frozen=True)
class _Sent:
    """A ``Traffic``'s bodies as the load sends them (``traffic`` of the loops below)."""

    bodies: list[bytes]
    items: list[int]
    header_lengths: list[int] | None


def _background(arguments: tuple, sending: Any, stopping: Any, results: Any) -> None:
    with collector_frozen():
        result = asyncio.run(_open(*arguments, stopping=stopping, sending=sending, keep_events=True))
    results.put(result)


def check_loopback(url: str) -> None:
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
    except asyncio.TimeoutError:
        status = "timeout"
    rec.record(start, status, items)


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
    check_loopback(url)
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
    stopping: Any = None,  # an Event: stop sending once set
    sending: Any = None,  # an Event: set as the first request is scheduled
    keep_events: bool = False,
) -> LoadResult:
    check_loopback(url)
    rec = _Recorder(keep_events)
    rng = np.random.default_rng(seed)
    count = int(rate * duration_s)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count))
    in_flight: set[asyncio.Task] = set()
    async with _session(headers, max_in_flight) as session:
        cpu0, t0 = time.process_time(), time.perf_counter()
        if sending is not None:
            sending.set()
        for k, offset in enumerate(arrivals):
            if stopping is not None and stopping.is_set():
                break
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
    check_loopback(f"grpc://{target}")
    with collector_frozen():
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

    from handlers.runtime.remote.grpc_stubs import inference_stub, messages

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
                rec.record(start, status, traffic.items[i])

        await asyncio.gather(*(sender() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        return rec.result("closed", concurrency, wall, time.process_time() - cpu0)
