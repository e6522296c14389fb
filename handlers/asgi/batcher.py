"""Batching in the server: one model's concurrent requests collected into batches, as TorchServe
collects them (``batchSize``, ``maxBatchDelay`` of the archive's ``model-config.yaml``), each batch
handed whole to ``ScoringService.handle`` on the process's forward thread.

A batch starts with the first request to arrive; the collector then takes what arrives until the
batch holds ``batch_size`` requests, ``max_delay_ms`` have passed since its first, or no request
can arrive before one is answered (``cannot_grow``: every client connection waits on an answer,
``connections.py``), and runs it off the event loop. Every model of a process shares one forward
thread: one forward at a time.

    batcher = Batcher(service_handle, BatchPolicy(batch_size=8, max_delay_ms=5), forwards, rule, cannot_grow)
    batcher.start()                        # inside the running event loop
    response = await batcher.submit(arrival)   # Response; raises ServiceUnavailable when shed
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from concurrent.futures import Executor
from typing import Any, Callable, Mapping, Sequence

from handlers.asgi.admission import AdmissionRule
from handlers.runtime.errors import InputError, ServiceUnavailable
from handlers.runtime.wire.messages import Response
from handlers.runtime.wire.transport import Arrival

# TorchServe's own defaults, where model-config.yaml names neither.
DEFAULT_BATCH_SIZE = 1
DEFAULT_MAX_DELAY_MS = 100


@dataclasses.dataclass(frozen=True)
class BatchPolicy:
    """At most ``batch_size`` requests per batch, collected for at most ``max_delay_ms``."""

    batch_size: int = DEFAULT_BATCH_SIZE
    max_delay_ms: float = DEFAULT_MAX_DELAY_MS

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any], where: str) -> "BatchPolicy":
        """TorchServe's ``batchSize`` and ``maxBatchDelay`` (ms) of a ``model-config.yaml``."""
        size = config.get("batchSize", DEFAULT_BATCH_SIZE)
        delay = config.get("maxBatchDelay", DEFAULT_MAX_DELAY_MS)
        if type(size) is not int or size < 1:
            raise InputError(f"{where}: batchSize: must be a whole number >= 1, got {size!r}")
        if not isinstance(delay, (int, float)) or isinstance(delay, bool) or delay < 0:
            raise InputError(f"{where}: maxBatchDelay: must be a number of ms >= 0, got {delay!r}")
        return cls(size, float(delay))


class Batcher:
    """``handle``: a batch of arrivals -> one response each, in order (run on ``forwards``);
    ``cannot_grow``: True when no request can arrive before one is answered (a batch stops waiting);
    ``started``: told, as a batch starts, how long (s) each of its requests waited."""

    def __init__(
        self,
        handle: Callable[[Sequence[Arrival]], Sequence[Response]],
        policy: BatchPolicy,
        forwards: Executor,
        admission: AdmissionRule,
        cannot_grow: Callable[[], bool] = lambda: False,
        started: Callable[[list[float]], None] = lambda waited_s: None,
    ) -> None:
        self.handle = handle
        self.policy = policy
        self.forwards = forwards
        self.admission = admission
        self.cannot_grow = cannot_grow
        self.started = started
        self.batches: collections.Counter[int] = collections.Counter()  # requests in a batch -> batches
        self._queue: collections.deque[tuple[Arrival, asyncio.Future, float]] = collections.deque()
        self._arrived = asyncio.Event()
        self._idle = True  # the collector waits for a batch's first request
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._collect())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def drain(self) -> None:
        """Returns once every request submitted so far is answered (before ``stop``, to unload)."""
        while self._queue or not self._idle:
            await asyncio.sleep(0.005)

    async def submit(self, arrival: Arrival) -> Response:
        """The request's response, once its batch ran; ``ServiceUnavailable`` at once when the
        admission rule sheds it."""
        refusal = self.admission.refusal(len(self._queue), self._idle)
        if refusal is not None:
            raise ServiceUnavailable(refusal)
        answered = asyncio.get_running_loop().create_future()
        self._queue.append((arrival, answered, time.monotonic()))
        self._arrived.set()
        return await answered

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        last_start, last_requests = 0.0, 0
        while True:
            if last_requests and self._queue:  # requests waited while the last batch ran: all of it was work
                self.admission.measured(time.monotonic() - last_start, last_requests)
            self._idle = True
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            self._idle = False
            last_start = time.monotonic()
            batch = await self._fill([self._queue.popleft()], last_start + self.policy.max_delay_ms / 1000)
            last_requests = len(batch)
            self.batches[len(batch)] += 1
            now = time.monotonic()
            self.started([now - queued for _, _, queued in batch])
            try:
                responses = await loop.run_in_executor(self.forwards, self.handle, [a for a, _, _ in batch])
            except Exception as error:  # the runtime answers each request's own errors: this is a bug
                for _, answered, _ in batch:
                    if not answered.done():
                        answered.set_exception(error)
                continue
            for (_, answered, _), response in zip(batch, responses):
                if not answered.done():  # its client may have gone
                    answered.set_result(response)
            await asyncio.sleep(0)  # the answered requests' routes run first: their clients no longer wait

    async def _fill(self, batch: list, deadline: float) -> list[tuple[Arrival, asyncio.Future, float]]:
        """Takes arrivals into ``batch`` until it holds ``batch_size``, ``deadline`` (monotonic s)
        passes, or none can arrive (``cannot_grow``)."""
        while len(batch) < self.policy.batch_size:
            if self._queue:
                batch.append(self._queue.popleft())
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.cannot_grow():
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                break
        return batch
