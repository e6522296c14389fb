"""The ASGI engine's metrics, on ``GET /metrics`` (Prometheus' text format, no key, as TorchServe's
metrics port), under the TorchServe path's names so that ``config/grafana/torchrec-serve.json``
reads either engine:

* the handler's counters (``handlers.runtime.batch_counts.COUNTERS``), labelled ``ModelName``,
  ``Level="Model"``, ``Hostname`` and their own labels, as TorchServe publishes them;
* TorchServe's ``ts_inference_requests_total`` (requests that ran in a batch) and
  ``ts_queue_latency_microseconds`` (their time in the queue), labelled ``model_name``,
  ``model_version``, ``hostname``.

Every process of a server counts into one directory (prometheus_client's multiprocess mode,
``metrics_dir.use_directory``; ``server.run`` makes one per run), and a scrape, answered by any
process, sums them all. TorchServe's counters carry no ``_total`` (``HandlerBatches``), which
prometheus_client's text format would add: those are exposed under their own name, typed
``untyped``.

    metrics = EngineMetrics()                        # in each server process
    tiny = metrics.model("tiny", "1.0")
    tiny.add(batch_increments(2, handled.stats))     # on the forward thread
    tiny.queued([0.004, 0.001])                      # a batch's requests, seconds each waited
    body = scrape()                                  # every process's sums
"""

from __future__ import annotations

import asyncio
import os
import socket
from concurrent.futures import Executor
from typing import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from handlers.runtime.batch_counts import COUNTERS, Increment

REQUESTS = "ts_inference_requests_total"
QUEUE_US = "ts_queue_latency_microseconds"
TORCHSERVE_LABELS = ("model_name", "model_version", "hostname")
MIN_READ_S = 0.1  # a raw-id model's counts are read at most this often
UNSUFFIXED = frozenset(COUNTERS) | {QUEUE_US}  # counters TorchServe names without ``_total``


class EngineMetrics:
    """One process's counters (no registry: a scrape reads every process's files)."""

    def __init__(self) -> None:
        self.hostname = socket.gethostname()
        self.handler = {
            name: Counter(name, what, ("ModelName", "Level", "Hostname", *labels), registry=None)
            for name, (labels, what) in COUNTERS.items()
        }
        self.requests = Counter(REQUESTS, "requests that ran in a batch", TORCHSERVE_LABELS, registry=None)
        self.queue_us = Counter(QUEUE_US, "time those requests waited in the queue", TORCHSERVE_LABELS, registry=None)

    def model(self, name: str, version: str | None) -> "ModelMetrics":
        return ModelMetrics(self, name, version or "")


class ModelMetrics:
    """One model's share of ``EngineMetrics``."""

    def __init__(self, metrics: EngineMetrics, name: str, version: str) -> None:
        self.metrics = metrics
        self.base = {"ModelName": name, "Level": "Model", "Hostname": metrics.hostname}
        self.torchserve = {"model_name": name, "model_version": version, "hostname": metrics.hostname}

    def add(self, increments: Iterable[Increment]) -> None:
        for name, labels, value in increments:
            self.metrics.handler[name].labels(**self.base, **dict(labels)).inc(value)

    def queued(self, waited_s: Sequence[float]) -> None:
        """A batch's requests, as it starts: how long each waited."""
        self.metrics.requests.labels(**self.torchserve).inc(len(waited_s))
        self.metrics.queue_us.labels(**self.torchserve).inc(sum(waited_s) * 1e6)


async def read_every(read: Callable[[], None], every_s: float, forwards: Executor) -> None:
    """Calls ``read`` every ``every_s`` (at least ``MIN_READ_S``) on the forward thread, between
    batches: a raw-id model's in-graph counts, which add up whatever the batches (read per batch
    they would cost more than a row lookup's share of it)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(max(every_s, MIN_READ_S))
        await loop.run_in_executor(forwards, read)


class _TorchServeNames:
    """prometheus_client's families, with counters not named ``*_total`` under their own name."""

    def __init__(self, inner: MultiProcessCollector) -> None:
        self.inner = inner

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            if family.type != "counter" or family.name not in UNSUFFIXED:
                yield family
                continue
            renamed = Metric(family.name, family.documentation, "unknown")
            for sample in family.samples:
                if sample.name == f"{family.name}_total":
                    renamed.add_sample(family.name, sample.labels, sample.value)
            yield renamed


def scrape() -> bytes:
    """Every process's counts, summed, in Prometheus' text format."""
    registry = CollectorRegistry()
    registry.register(_TorchServeNames(MultiProcessCollector(None)))
    return generate_latest(registry)
