"""The TorchServe entry point: a thin adapter from TorchServe's worker API to ``ScoringService``.

TorchServe calls ``initialize(context)`` once per worker and ``handle(data, context)`` per batch of
requests (``batchSize`` / ``maxBatchDelay``). Model loading is our own (``ScoringService.from_dir``:
the spec plus the artifact that the ``handler`` section of ``model-config.yaml`` names, parsed into
``HandlerOptions``: an AOTInductor package, an exported program, the eager model on memory-mapped
weights, or a split sparse/dense pair of those), not BaseHandler's. This module defines exactly one
class, as TorchServe's class entry point requires.

Metrics (Prometheus counters on the metrics API, with ``model_metrics_auto_detect=true``):
``HandlerBatches{Requests="k"}`` counts the TorchServe batches of k requests the worker received,
``HandlerForwards`` the model forwards and ``HandlerForwardItems`` the items they scored.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from ts.metrics.dimension import Dimension

from handlers.options import HandlerOptions
from handlers.service import ScoringService

logger = logging.getLogger(__name__)


class DLRMHandler:
    def __init__(self) -> None:
        self.service: ScoringService | None = None

    def initialize(self, context: Any) -> None:
        started = time.perf_counter()
        model_dir = Path(context.system_properties["model_dir"])
        options = HandlerOptions.from_mapping((context.model_yaml_config or {}).get("handler"))
        torch.set_num_threads(options.intra_op_threads)
        self.service = ScoringService.from_dir(model_dir, options.artifact, options.split)
        logger.info(
            "loaded model %s from %s, running %s in %.2fs, %d intra-op threads",
            self.service.spec.name,
            model_dir,
            options.describe(),
            time.perf_counter() - started,
            options.intra_op_threads,
        )

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        assert self.service is not None, "initialize() was not called"
        payloads = [row.get("body", row.get("data")) for row in data]
        responses = self.service.handle(payloads)
        self._count(context, "HandlerBatches", 1, Dimension("Requests", str(len(data))))
        forwards = self.service.last_forward_items
        self._count(context, "HandlerForwards", len(forwards))
        self._count(context, "HandlerForwardItems", sum(forwards))
        for index, response in enumerate(responses):
            context.set_response_status(response.status, "", idx=index)
            context.set_response_content_type(index, "application/json")
        return [r.body for r in responses]

    @staticmethod
    def _count(context: Any, name: str, value: int, *extra: Dimension) -> None:
        dimensions = [Dimension("ModelName", context.model_name), Dimension("Level", "Model"), *extra]
        context.metrics.add_counter(name, value, None, dimensions)
