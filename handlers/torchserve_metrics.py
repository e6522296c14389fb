"""The handler's metrics, published through TorchServe's metrics API (Prometheus, with
``model_metrics_auto_detect=true``); each carries ``ModelName`` and ``Level="Model"``.

| name | type | unit | labels | what |
|---|---|---|---|---|
| ``HandlerBatches`` | counter | batches | ``Requests`` | TorchServe batches of k requests |
| ``HandlerForwards`` | counter | forwards | | model forwards (a batch over the item cap runs several) |
| ``HandlerForwardItems`` | counter | items | | items scored; / ``HandlerForwards`` = items per forward |
| ``HandlerStageTime`` | histogram | ms | ``Stage`` | per batch: decode, coalesce, forward, encode |
| ``HandlerRejectedRequests`` | counter | requests | ``Reason`` | 4xx answers, by ``BadRequest`` reason |
| ``HandlerHashedIds`` | counter | ids | | ids outside their table, hashed by the ``hash`` policy |

(An id refused by the ``reject`` policy counts as ``HandlerRejectedRequests{Reason="id_out_of_range"}``.)
Queue time is TorchServe's own: ``ts_queue_latency_microseconds`` over ``ts_inference_requests_total``.
"""

from __future__ import annotations

from typing import Any

from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes

from handlers.runtime.service import BatchStats


def publish(context: Any, requests: int, stats: BatchStats) -> None:
    """Adds one TorchServe batch of ``requests`` requests to the model's metrics."""
    metrics, model = context.metrics, context.model_name

    def dimensions(*extra: Dimension) -> list[Dimension]:
        return [Dimension("ModelName", model), Dimension("Level", "Model"), *extra]

    metrics.add_counter("HandlerBatches", 1, None, dimensions(Dimension("Requests", str(requests))))
    metrics.add_counter("HandlerForwards", len(stats.forward_items), None, dimensions())
    metrics.add_counter("HandlerForwardItems", sum(stats.forward_items), None, dimensions())
    for stage, ms in stats.stage_ms.items():
        metrics.add_metric(
            "HandlerStageTime", ms, "ms", None, dimensions(Dimension("Stage", stage)),
            MetricTypes.HISTOGRAM,
        )
    for reason, count in stats.rejected.items():
        metrics.add_counter(
            "HandlerRejectedRequests", count, None, dimensions(Dimension("Reason", reason))
        )
    if stats.hashed_ids:
        metrics.add_counter("HandlerHashedIds", stats.hashed_ids, None, dimensions())
