"""The TorchServe entry point: a thin adapter from TorchServe's worker API to ``ScoringService``.

TorchServe calls ``initialize(context)`` once per worker and ``handle(data, context)`` per batch of
requests (``batchSize`` / ``maxBatchDelay``). Model loading is our own (``handlers.loading``: the
artifact that the ``handler`` section of ``model-config.yaml`` names, parsed into
``HandlerOptions``), not BaseHandler's. This module defines exactly one class, as TorchServe's
class entry point requires.

Metrics: ``handlers.torchserve_metrics`` (per-stage times, batches, forwards, rejected requests).
Threads: a forward of at least ``parallel_from_items`` items runs on ``intra_op_threads`` threads,
a smaller one on one (``HandlerOptions.threads_for``).

``GET /models/NAME?customized=true`` (management API) answers with what each worker runs: its pid,
artifact, device, load time, whether TorchRec or TorchAO were imported, and whether its garbage
collector is on (paused while it starts). The plugin's freshness calls (publish checks, state,
rollback) do not come through here: they travel through the model's mailbox folder, answered by
the freshness thread (``handlers.runtime.freshness.protocol``).

Reading: from the first request on, the worker reads the frontend's socket through one buffer
(``handlers.torchserve_internals.FrameReader``), not a system call per field of a request.

Garbage collection: a worker starts (this module's imports, then the model's load) with the
collector paused. TorchServe has imported torch before this module, and every full collection that
the new objects of TorchRec's and FBGEMM's imports trigger walks torch's half million again: a
tenth to a quarter of the start's CPU after torch (a Criteo-shaped model measured here: eager 2.5
CPU-seconds, 2.25 paused; compiled 1.7 and 1.3), for a few thousand objects of garbage, collected
once loaded (the worker's RSS 7 MiB more: 360 and 367 MiB). Then every object alive (torch, the
model, TorchServe) is frozen out of the collector's reach (``gc.freeze``) and the collector
resumes. Without the freeze a full collection, which request garbage triggers every few seconds,
walks them all and stalls the worker for 200-350 ms: the p99 of a lightly loaded server.
"""

from __future__ import annotations

import gc

gc.disable()  # until initialize() has loaded the model: the imports below are most of a start

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from handlers.loading import load_service
from handlers.runtime.freshness.config import FreshnessConfig
from handlers.runtime.freshness.worker import LockedRunner, WorkerFreshness
from handlers.runtime.options import HandlerOptions
from handlers.runtime.remote.lookups import ShardedLookups
from handlers.runtime.service import ScoringService
from handlers.runtime.wire.v2_headers import HEADER_LENGTH
from handlers.runtime.wire.transport import Arrival
from handlers.torchserve_internals import read_frames_buffered
from handlers.torchserve_metrics import MetricsPublisher, quiet_per_batch_lines

logger = logging.getLogger(__name__)


class DLRMHandler:
    def __init__(self) -> None:
        self.service: ScoringService | None = None
        self.metrics: MetricsPublisher | None = None
        self.description: dict[str, Any] = {}
        self.freshness: WorkerFreshness | str | None = None  # or why the archive takes no deltas
        self.shard_calls: ShardedLookups | None = None

    def initialize(self, context: Any) -> None:
        try:
            self._load(context)
            gc.collect()  # the start's garbage; what is left lives as long as the worker
            gc.freeze()
        finally:
            gc.enable()

    def _load(self, context: Any) -> None:
        started = time.perf_counter()
        model_dir = Path(context.system_properties["model_dir"])
        gpu_id = context.system_properties.get("gpu_id")
        options = HandlerOptions.from_mapping((context.model_yaml_config or {}).get("handler"))
        config = FreshnessConfig.from_mapping((context.model_yaml_config or {}).get("freshness"))
        freshness = self.freshness = WorkerFreshness.open(model_dir, options, config)  # the tables' working copy
        tables = freshness.weights_file if isinstance(freshness, WorkerFreshness) else None
        version = (context.manifest or {}).get("model", {}).get("modelVersion")
        self.service = load_service(
            model_dir, options, gpu_id, model_name=context.model_name, tables_file=tables, model_version=version
        )
        if isinstance(freshness, WorkerFreshness):
            freshness.start(self.service.model)  # the model's delta log replayed before the first request
            self.service.model = LockedRunner(self.service.model, freshness.lock)
        self.metrics = MetricsPublisher(options.metrics_flush_s, self.service.unseen_ids)
        quiet_per_batch_lines()
        unbuffered = read_frames_buffered()
        if unbuffered is not None:
            logger.info("reading requests with TorchServe's own reader: %s", unbuffered)
        lookups = getattr(self.service.model, "sparse", None)  # a dense host's calls to its shards
        self.shard_calls = lookups if isinstance(lookups, ShardedLookups) else None
        load_s = time.perf_counter() - started
        self.description = {
            "pid": os.getpid(),
            "runs": options.describe(),
            "gpu_id": gpu_id,
            "intra_op_threads": options.intra_op_threads,
            "load_s": round(load_s, 3),
            "imports_torchrec": "torchrec" in sys.modules,
            "imports_torchao": "torchao" in sys.modules,
        }
        logger.info(
            "loaded model %s from %s, running %s in %.2fs, %d intra-op threads",
            context.model_name,
            model_dir,
            options.describe(),
            load_s,
            options.intra_op_threads,
        )

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        assert self.service is not None, "initialize() was not called"
        if context.get_request_header(0, "describe") == "True":  # GET /models/NAME?customized=true
            self.metrics.flush(context)  # type: ignore[union-attr]  # so that a scrape now is exact
            return [orjson.dumps({**self.description, "collector": _collector()})]
        payloads = [_payload(row, context.get_all_request_header(index)) for index, row in enumerate(data)]
        with self.metrics.lock:  # type: ignore[union-attr]  # no idle flush reads the counts during a forward
            handled = self.service.handle(payloads)
            shard_counts = self.shard_calls.take_counts() if self.shard_calls is not None else None
            self.metrics.add(context, len(data), handled.stats, shard_counts)  # type: ignore[union-attr]
        for index, response in enumerate(handled.responses):
            if response.status != 200:  # TorchServe answers 200 where none is set
                context.set_response_status(response.status, "", idx=index)
            context.set_response_content_type(index, response.content_type)
            for name, value in response.headers.items():
                context.set_response_header(index, name, value)
        return [r.body for r in handled.responses]


def _collector() -> dict[str, Any]:
    """The garbage collector as the worker runs it (not how many objects it froze: counting them
    walks them all, 25 ms with the GIL held)."""
    return {"enabled": gc.isenabled()}


def _payload(row: dict[str, Any], headers: dict[str, str]) -> Arrival:
    """One request as TorchServe hands it over: REST puts the body under ``body`` with the HTTP
    headers beside it (a form's fields under their own names instead); gRPC puts each entry of
    ``PredictionsRequest.input`` under its own key. A KServe v2 binary body comes with its JSON
    header's length (``Inference-Header-Content-Length``: a header on REST, an input entry on
    gRPC)."""
    length = row.get(HEADER_LENGTH)
    body = row.get("body")
    return Arrival(
        body=body if body is not None else row.get("data"),
        content_type=_header(headers, "Content-Type"),
        content_encoding=_header(headers, "Content-Encoding"),
        header_length=length if length is not None else _header(headers, HEADER_LENGTH),
    )


def _header(headers: dict[str, str], name: str) -> str | None:
    value = headers.get(name)
    return value if value is not None else headers.get(name.lower())
