"""The handler's counters, engine-neutral: a scored batch as ``(name, labels, value)`` increments,
which each engine's publisher sends out under these names (TorchServe's metrics API:
``handlers/torchserve_metrics.py``; the ASGI engine's Prometheus endpoint:
``handlers/asgi/metrics.py``). ``COUNTERS`` names every one with its labels (beyond the model's).

    list(batch_increments(2, stats))
    # [("HandlerBatches", (("Requests", "2"),), 1), ("HandlerForwards", (), 1),
    #  ("HandlerForwardItems", (), 5), ("HandlerStageMilliseconds", (("Stage", "decode"),), 0.4), ...]
"""

from __future__ import annotations

from typing import Iterator

from handlers.runtime.service import BatchStats
from handlers.runtime.unseen_ids import UnseenIdCounter

Labels = tuple[tuple[str, str], ...]
Increment = tuple[str, Labels, float]

# name -> (its labels, what it counts)
COUNTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "HandlerBatches": (("Requests",), "batches of k requests"),
    "HandlerForwards": ((), "model forwards (a batch over the item cap runs several)"),
    "HandlerForwardItems": ((), "items scored"),
    "HandlerStageMilliseconds": (("Stage",), "time in decode, coalesce, forward, encode"),
    "HandlerRejectedRequests": (("Reason",), "4xx answers, by reason"),
    "HandlerSplitForwards": ((), "forwards that raised and were split"),
    "HandlerHashedIds": ((), "ids outside their table, hashed"),
    "HandlerPrunedIds": (("Table",), "ids of a pruned table that have no row"),
    "HandlerUnseenIds": (("Table",), "ids of a raw-id table that own no slot"),
    "HandlerRawIds": (("Table",), "ids of a raw-id table looked up"),
    "ShardCalls": (("Shard", "Outcome"), "a dense host's calls to its embedding shards"),
    "ShardCallMilliseconds": (("Shard",), "time in a dense host's shard calls"),
}


def batch_increments(requests: int, stats: BatchStats) -> Iterator[Increment]:
    """One batch of ``requests`` requests (its ``ScoringService.handle`` stats)."""
    yield "HandlerBatches", (("Requests", str(requests)),), 1
    yield "HandlerForwards", (), len(stats.forward_items)
    yield "HandlerForwardItems", (), sum(stats.forward_items)
    for stage, ms in stats.stage_ms.items():
        yield "HandlerStageMilliseconds", (("Stage", stage),), ms
    for reason, count in stats.rejected.items():
        yield "HandlerRejectedRequests", (("Reason", reason),), count
    if stats.hashed_ids:
        yield "HandlerHashedIds", (), stats.hashed_ids
    if stats.split_forwards:
        yield "HandlerSplitForwards", (), stats.split_forwards
    for table, count in stats.pruned_ids.items():
        yield "HandlerPrunedIds", (("Table", table),), count


def raw_id_increments(raw_ids: UnseenIdCounter) -> Iterator[Increment]:
    """A raw-id model's in-graph counts since the last call (``UnseenIdCounter.since_last``)."""
    for name, counts in zip(("HandlerUnseenIds", "HandlerRawIds"), raw_ids.since_last()):
        for table, count in counts.items():
            yield name, (("Table", table),), count
