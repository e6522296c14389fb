"""The benchmark scenarios and their targets (``python -m benchmarks SCENARIO``).

* ``smoke``: the tiny spec, a few seconds per load level; CI runs it to keep the tool working.
* ``criteo``: the Criteo-shaped spec (26 int8 tables capped at 100k rows): batching off vs on,
  one-item and 100-candidate requests, closed loop at concurrency 1/8/32 and open loop.

Targets compare with TorchServe's own DLRM example measured on this kind of machine
(``shared/CRITEO_1TB.md``): 2,144 items/s with p99 101 ms at batch_size 32, concurrency 32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from benchmarks.traffic import TrafficModel

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "config" / "models"

# In a 100-candidate request these features vary per candidate; the rest is the user's context.
CRITEO_CANDIDATE_FEATURES = ("cat_9", "cat_19", "cat_20", "cat_21")


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    traffic: TrafficModel
    concurrencies: tuple[int, ...]
    open_rates: tuple[float, ...]  # offered requests/s


@dataclasses.dataclass(frozen=True)
class Target:
    """``metric`` of the run (workload, batch_size, closed-loop concurrency) compared with ``value``.

    Metrics: items_per_s, p50_ms, p99_ms, efficiency (served / in-process items/s).
    """

    label: str
    workload: str
    batch_size: int
    concurrency: int
    metric: str
    op: str  # ">=" or "<="
    value: float

    def met(self, measured: float) -> bool:
        return measured >= self.value if self.op == ">=" else measured <= self.value


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    spec: Path
    batch_sizes: tuple[int, ...]
    max_batch_delay_ms: int
    workloads: tuple[Workload, ...]
    duration_s: float  # per load level
    max_requests: int  # per load level
    pool_requests: int  # distinct requests generated per workload (cycled)
    targets: tuple[Target, ...] = ()


REFERENCE_ITEMS_PER_S = 2144.0  # TorchServe DLRM example, batch_size 32, concurrency 32
REFERENCE_P99_MS = 101.0

SCENARIOS = {
    "smoke": Scenario(
        name="smoke",
        spec=MODELS / "tiny.yaml",
        batch_sizes=(1, 8),
        max_batch_delay_ms=5,
        workloads=(
            Workload("one-item", TrafficModel(items_per_request=1, mean_bag=2.0), (1, 8), (50.0,)),
            Workload(
                "candidates-20",
                TrafficModel(items_per_request=20, mean_bag=2.0, candidate_features=("item_id",)),
                (4,),
                (),
            ),
        ),
        duration_s=1.5,
        max_requests=2000,
        pool_requests=64,
    ),
    "criteo": Scenario(
        name="criteo",
        spec=MODELS / "criteo.yaml",
        batch_sizes=(1, 32),
        max_batch_delay_ms=5,
        workloads=(
            Workload("one-item", TrafficModel(items_per_request=1), (1, 8, 32), (250.0, 1000.0)),
            Workload(
                "candidates-100",
                TrafficModel(items_per_request=100, candidate_features=CRITEO_CANDIDATE_FEATURES),
                (1, 8, 32),
                (20.0,),
            ),
        ),
        duration_s=10.0,
        max_requests=200_000,
        pool_requests=512,
        targets=(
            Target(
                "one-item, c=32, batch 32: items/s >= 2x the reference 2,144",
                "one-item", 32, 32, "items_per_s", ">=", 2 * REFERENCE_ITEMS_PER_S,
            ),
            Target(
                "one-item, c=32, batch 32: p99 <= half the reference 101 ms",
                "one-item", 32, 32, "p99_ms", "<=", REFERENCE_P99_MS / 2,
            ),
            Target(
                "100 candidates, c=32, batch 32: >= 80% of in-process items/s",
                "candidates-100", 32, 32, "efficiency", ">=", 0.8,
            ),
        ),
    ),
}
