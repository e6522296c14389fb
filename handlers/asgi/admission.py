"""Admission: a request that would wait too long in its model's queue is refused at once (a 503),
so that the requests accepted keep their latency under overload. The rule is the TorchServe
plugin's (``archive_tools/plugin/java/.../AdmissionQueue.java``), for one process's queue:

* the queue measures its batches: the time from taking a batch's first request to coming back
  for the next one while requests wait (all of it work), and that time per request in the batch,
  each the median of the last ``RECENT_BATCHES`` (one batch a pause of the machine held does not
  move it, where an average inflated the wait predicted for the requests queued behind the pause);
* a request arriving behind ``n`` waiting ones would wait about the lesser of ``(n + 1) x request
  time`` and ``ceil((n + 1) / batch size) x batch time`` (after one slow batch of few requests the
  per-request time is inflated; whole batches keep a short queue from being shed);
* it is refused when that exceeds the target: ``guard.max_queue_wait_ms``, or four batch times
  (at least 100 ms) when that is 0; and when the queue already holds ``capacity`` requests
  (TorchServe's ``job_queue_size``); never while the collector waits for a first request.

    rule = AdmissionRule(label="model tiny version 1.0", batch_size=8, max_queue_wait_ms=20)
    rule.measured(elapsed_s=0.004, requests=8)
    rule.refusal(waiting=30, idle=False)   # -> "a request now would wait about 15 ms ..." or None
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics

MIN_TARGET_S = 0.100  # a closed loop of clients on an unbatched model is not shed
QUEUE_CAPACITY = 1000  # the project's TorchServe config: job_queue_size
RECENT_BATCHES = 15  # the measurements a median is taken over


@dataclasses.dataclass
class AdmissionRule:
    """One model's admission in one process (a single consumer: the process's collector)."""

    label: str
    batch_size: int
    max_queue_wait_ms: int = 0
    capacity: int = QUEUE_CAPACITY
    batch_s: float = 0.0  # measured; 0: not yet
    request_s: float = 0.0
    _batches: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=RECENT_BATCHES))
    _requests: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=RECENT_BATCHES))

    def measured(self, elapsed_s: float, requests: int) -> None:
        """A batch of ``requests`` took ``elapsed_s`` while others waited behind it."""
        if requests > 0:
            self._batches.append(elapsed_s)
            self._requests.append(elapsed_s / requests)
            self.batch_s = statistics.median_high(self._batches)
            self.request_s = statistics.median_high(self._requests)

    @property
    def target_s(self) -> float:
        if self.max_queue_wait_ms > 0:
            return self.max_queue_wait_ms / 1000
        return max(MIN_TARGET_S, 4 * self.batch_s)

    def predicted_wait_s(self, waiting: int) -> float:
        ahead = waiting + 1
        return min(ahead * self.request_s, math.ceil(ahead / max(1, self.batch_size)) * self.batch_s)

    def refusal(self, waiting: int, idle: bool) -> str | None:
        """Why a request arriving now, behind ``waiting`` queued ones, is refused; None: admitted.
        ``idle``: the collector waits for a batch's first request (nothing to predict)."""
        if waiting >= self.capacity:
            return f"{self.label} is overloaded: its queue holds {self.capacity} requests (jobQueueSize); retry with backoff"
        if idle and waiting == 0:
            return None
        wait_s, target_s = self.predicted_wait_s(waiting), self.target_s
        if wait_s <= target_s:
            return None
        source = "max_queue_wait_ms" if self.max_queue_wait_ms > 0 else "four batch times; set by max_queue_wait_ms"
        return (
            f"{self.label} is overloaded: a request now would wait about {wait_s * 1000:.0f} ms ({waiting} queued, "
            f"{self.request_s * 1000:.2f} ms each on 1 workers), over its {target_s * 1000:.0f} ms target "
            f"({source}); retry with backoff"
        )

