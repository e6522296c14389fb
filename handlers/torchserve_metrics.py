"""The handler's metrics, published through TorchServe's metrics API (Prometheus, with
``model_metrics_auto_detect=true``); each carries ``ModelName`` and ``Level="Model"``. The
increments are ``handlers.runtime.batch_counts``' (the ASGI engine publishes the same).

| name | type | labels | what |
|---|---|---|---|
| ``HandlerBatches`` | counter | ``Requests`` | TorchServe batches of k requests |
| ``HandlerForwards`` | counter | | model forwards (a batch over the item cap runs several) |
| ``HandlerForwardItems`` | counter | | items scored; / ``HandlerForwards`` = items per forward |
| ``HandlerStageMilliseconds`` | counter | ``Stage`` | time in decode, coalesce, forward, encode |
| ``HandlerRejectedRequests`` | counter | ``Reason`` | 4xx answers, by ``BadRequest`` reason |
| ``HandlerSplitForwards`` | counter | | forwards that raised and were split to find the requests that fail alone |
| ``HandlerHashedIds`` | counter | | ids outside their table, hashed by the ``hash`` policy |
| ``HandlerPrunedIds`` | counter | ``Table`` | ids of a pruned table that have no row (they look up a zero row) |
| ``HandlerUnseenIds`` | counter | ``Table`` | ids of a raw-id table that own no slot (they look up its default row, ZCH: their first probe) |
| ``HandlerRawIds`` | counter | ``Table`` | ids of a raw-id table looked up; unseen / raw = the unseen share |
| ``ShardCalls`` | counter | ``Shard``, ``Outcome`` | a dense host's calls to its embedding shards: ``ok`` or the gRPC status of a failed attempt |
| ``ShardCallMilliseconds`` | counter | ``Shard`` | time in those calls; / ``ShardCalls`` = mean call time |

(An id refused by the ``reject`` policy counts as ``HandlerRejectedRequests{Reason="id_out_of_range"}``;
mean time per batch in a stage is ``HandlerStageMilliseconds`` over ``HandlerBatches``.)
Queue time is TorchServe's own: ``ts_queue_latency_microseconds`` over ``ts_inference_requests_total``.

Every metric TorchServe's worker publishes is a log line the frontend parses, per batch per metric.
So the counts are summed in the worker and published at most every ``metrics_flush_s`` (at the
first batch after it elapses; 0: every batch): a handful of lines a second under load, not a dozen
per batch. A worker that gets no batch for ``metrics_flush_s`` publishes what it summed then (a
thread of the publisher's waits for that), so a scrape one interval after the last request sees
every count; a describe call (``GET /models/NAME?customized=true``) flushes them at once. Counts
of the last interval before a worker stops are not published. For the same reason the two lines
TorchServe's worker writes for every batch (``Backend received inference at: ...`` and its
``PredictionTime`` metric, which ``HandlerStageMilliseconds`` covers) are dropped
(``quiet_per_batch_lines``).

Publishing from that thread is safe: TorchServe's metric cache is only looked up (each counter
made once, by our lock's holder), and its lines go out through ``logging``, whose handlers write a
line at a time under their own lock. The publisher's lock is held around each batch's scoring as
well (``MetricsPublisher.lock``): a raw-id model's counts grow during its forwards, and are read
when published.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from ts.metrics.dimension import Dimension

from handlers.runtime.batch_counts import batch_increments, raw_id_increments
from handlers.runtime.service import BatchStats
from handlers.runtime.unseen_ids import UnseenIdCounter

logger = logging.getLogger(__name__)


class MetricsPublisher:
    """Sums batches' stats and publishes them as counter increments, at most every ``flush_s``,
    and ``flush_s`` after the last batch. ``raw_ids``: a raw-id model's in-graph counts, read when
    publishing (they add up in the graph whatever the batches: reading them per batch cost more
    than a row lookup's share of it).

        with publisher.lock:    # around a batch's scoring and its add
            handled = service.handle(payloads)
            publisher.add(context, len(payloads), handled.stats)
    """

    def __init__(self, flush_s: float, raw_ids: UnseenIdCounter | None = None) -> None:
        self.flush_s = flush_s
        self.raw_ids = raw_ids
        self.lock = threading.RLock()  # a batch (scoring, add), or a flush
        self._pending: collections.Counter[tuple[str, tuple[tuple[str, str], ...]]] = collections.Counter()
        self._last_flush = self._last_batch = time.monotonic()
        self._unpublished = False  # batches added since the last flush
        self._context: Any = None  # TorchServe's, as the last batch gave it
        self._batch_added = threading.Condition(self.lock)
        threading.Thread(target=self._flush_when_idle, name="metrics-idle-flush", daemon=True).start()

    def add(
        self, context: Any, requests: int, stats: BatchStats, shard_counts: collections.Counter | None = None
    ) -> None:
        """Adds one TorchServe batch of ``requests`` requests (and a dense host's shard calls,
        ``ShardedLookups.take_counts``); publishes if the interval is over."""
        with self.lock:
            pending = self._pending
            if shard_counts:
                pending.update(shard_counts)
            for name, labels, value in batch_increments(requests, stats):
                pending[(name, labels)] += value
            self._context, self._last_batch = context, time.monotonic()
            if self._last_batch - self._last_flush >= self.flush_s:
                self.flush(context)
            elif not self._unpublished:
                self._unpublished = True
                self._batch_added.notify()  # once per interval, not per batch

    def flush(self, context: Any) -> None:
        """Publishes what has been summed since the last flush."""
        with self.lock:
            self._last_flush = time.monotonic()
            self._unpublished = False
            if self.raw_ids is not None:
                for name, labels, value in raw_id_increments(self.raw_ids):
                    self._pending[(name, labels)] += value
            base = [Dimension("ModelName", context.model_name), Dimension("Level", "Model")]
            for (name, labels), value in self._pending.items():
                dimensions = base + [Dimension(key, label) for key, label in labels]
                # idx 0: the line carries one request id, not the whole batch's
                context.metrics.add_counter(name, value, 0, dimensions)
            self._pending.clear()

    def _flush_when_idle(self) -> None:
        """Publishes the counts once ``flush_s`` has passed with no batch since they were added."""
        with self.lock:
            while True:
                idle_s = time.monotonic() - self._last_batch
                if not self._unpublished:
                    self._batch_added.wait()
                elif idle_s < self.flush_s:
                    self._batch_added.wait(self.flush_s - idle_s)
                else:
                    try:
                        self.flush(self._context)
                    except Exception:  # the next batch's flush publishes them
                        logger.exception("publishing the metrics of an idle worker failed")


class _PerBatchLines(logging.Filter):
    """Lets through every record but TorchServe's two per-batch lines."""

    LINES = ("Backend received inference at", "[METRICS]PredictionTime")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.LINES))


def quiet_per_batch_lines() -> None:
    """Drops TorchServe's own per-batch worker lines: each is written to the worker's stdout, then
    read and parsed by the frontend. Warnings, errors and the handler's own lines still go out."""
    quiet = _PerBatchLines()
    for handler in logging.getLogger().handlers:  # the worker's stdout, where both lines go
        handler.addFilter(quiet)
