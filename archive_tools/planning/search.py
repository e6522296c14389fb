"""Choosing each table's dtype under an accuracy budget.

1. **Sensitivity.** Each table alone in each smaller dtype it can be served in (``fp16``, ``int8``,
   ``int4``, ``int2``), every other table float: its AUC drop and NE increase on the plan split.
   ``Budget.cost`` turns both into one number: 1.0 spends the whole budget.
2. **Combine.** From all tables float, repeatedly take the move (one table to a smaller dtype) that
   saves the most bytes per unit of cost measured alone, and measure the combination; keep it if
   the plan split stays within ``PLAN_SHARE`` of the budget, else rule out that move and smaller
   ones for the table. Every move either lowers a table or rules one out, so this ends.
3. **Hold out.** The combination, as the served model computes it (``TableProbe.served_quality``),
   on data it was not chosen on; while it breaks the budget, the last move taken is undone.

The uniform dtypes (every table in one dtype) are measured the same way, for comparison.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from tqdm import tqdm

from archive_tools.planning.probe import TableProbe
from archive_tools.verification import Quality
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.spec import ModelSpec, TableSpec, WeightDtype

PLAN_SHARE = 0.8  # of the budget the plan split may spend: the held-out data differs a little
_FREE = 1e-3  # a move's cost counted as at least this share of the budget: ties go to the bigger saving


@dataclasses.dataclass(frozen=True)
class Budget:
    max_auc_drop: float
    max_ne_increase: float

    def cost(self, reference: Quality, measured: Quality) -> float:
        """The share of the budget ``measured`` spends against ``reference`` (<= 1: within it)."""
        return max(
            (reference.auc - measured.auc) / self.max_auc_drop,
            (measured.ne - reference.ne) / self.max_ne_increase,
            0.0,
        )


@dataclasses.dataclass(frozen=True)
class Move:
    table: str
    before: WeightDtype
    after: WeightDtype
    saved_bytes: int
    plan_quality: Quality  # of the whole combination once the move was taken


@dataclasses.dataclass(frozen=True)
class Point:
    """One assignment of dtypes to tables: its table bytes and its served quality on held-out data."""

    label: str
    dtypes: dict[str, WeightDtype]
    table_bytes: int
    holdout: Quality
    max_abs_score_diff: float  # from the float model's scores, on held-out data
    within_budget: bool


@dataclasses.dataclass(frozen=True)
class PlanSearch:
    budget: Budget
    float_plan: Quality
    float_holdout: Quality
    alone: dict[tuple[str, WeightDtype], Quality]  # one table in one dtype, on the plan split
    moves: list[Move]  # taken, in order (after backing off)
    backed_off: list[Move]  # undone on the held-out data, last first
    planned: Point
    given: Point
    uniform: list[Point]
    table_bytes: dict[tuple[str, WeightDtype], int]  # each table in each dtype it can be served in
    evaluations: int
    seconds: float
    stopped_early: bool  # --max-minutes ran out before every move was tried


class TableBytes:
    """Bytes of each table in each dtype as served (FBGEMM's row layout, alignment included)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.bytes: dict[tuple[str, WeightDtype], int] = {}
        for dtype in WeightDtype:
            variant = spec.replace(tables=[_in(spec, t, dtype) for t in spec.tables])
            served_as = {t.name: t.weight_dtype for t in variant.tables}
            for table, size in DLRMFactory(variant).table_bytes().items():
                self.bytes[(table, served_as[table])] = size

    def of(self, dtypes: dict[str, WeightDtype]) -> int:
        return sum(self.bytes[(name, dtype)] for name, dtype in dtypes.items())


def search(
    spec: ModelSpec,
    probe: TableProbe,
    budget: Budget,
    max_seconds: float | None = None,
    progress: Callable[..., tqdm] = tqdm,
) -> PlanSearch:
    started = time.monotonic()
    out_of_time = lambda: max_seconds is not None and time.monotonic() - started > max_seconds  # noqa: E731
    sizes = TableBytes(spec)
    ladders = {t.name: spec.servable_dtypes(t) for t in spec.tables}
    top = {name: ladder[0] for name, ladder in ladders.items()}
    float_plan = probe.quality("plan", {})

    alone: dict[tuple[str, WeightDtype], Quality] = {}
    steps = [(name, dtype) for name, ladder in ladders.items() for dtype in ladder[1:]]
    for name, dtype in progress(steps, desc="plan: each table alone", unit="eval"):
        if out_of_time():
            break
        alone[(name, dtype)] = probe.quality("plan", {name: dtype})
    stopped_early = len(alone) < len(steps)

    def alone_cost(name: str, dtype: WeightDtype) -> float:
        return 0.0 if dtype == top[name] else budget.cost(float_plan, alone[(name, dtype)])

    current = dict(top)
    moves: list[Move] = []
    ruled_out: dict[str, int] = {name: len(ladder) for name, ladder in ladders.items()}  # ladder index
    bar = progress(desc="plan: combine", unit="eval", total=None)
    while not out_of_time():
        candidates = []
        for name, ladder in ladders.items():
            at = ladder.index(current[name])
            for dtype in ladder[at + 1 : ruled_out[name]]:
                if (name, dtype) not in alone:
                    continue
                saved = sizes.bytes[(name, current[name])] - sizes.bytes[(name, dtype)]
                if saved <= 0:  # FBGEMM's row alignment can make a narrower dtype no smaller
                    continue
                extra = max(alone_cost(name, dtype) - alone_cost(name, current[name]), _FREE)
                candidates.append((saved / extra, saved, name, dtype))
        if not candidates:
            break
        _, saved, name, dtype = max(candidates, key=lambda c: (c[0], c[1]))
        trial = {**current, name: dtype}
        measured = probe.quality("plan", trial)
        bar.update()
        if budget.cost(float_plan, measured) <= PLAN_SHARE:
            moves.append(Move(name, current[name], dtype, saved, measured))
            current = trial
        else:
            ruled_out[name] = ladders[name].index(dtype)
    stopped_early = stopped_early or out_of_time()
    bar.close()

    float_holdout = probe.quality("holdout", {})  # the float model: what the build's gate compares with

    def point(label: str, dtypes: dict[str, WeightDtype]) -> Point:
        holdout, max_diff = probe.served_quality("holdout", dtypes)
        return Point(label, dict(dtypes), sizes.of(dtypes), holdout, max_diff, budget.cost(float_holdout, holdout) <= 1.0)

    backed_off: list[Move] = []
    planned = point("plan", current)
    while not planned.within_budget and moves:
        undone = moves.pop()
        backed_off.append(undone)
        current = {**current, undone.table: undone.before}
        planned = point("plan", current)
    uniform = [
        point(f"all {dtype.value}", {t.name: _in(spec, t, dtype).weight_dtype for t in spec.tables})
        for dtype in progress(list(WeightDtype), desc="plan: uniform dtypes", unit="dtype")
    ]
    given = point("given spec", {t.name: t.weight_dtype for t in spec.tables})
    return PlanSearch(
        budget=budget,
        float_plan=float_plan,
        float_holdout=float_holdout,
        alone=alone,
        moves=moves,
        backed_off=backed_off,
        planned=planned,
        given=given,
        uniform=uniform,
        table_bytes=sizes.bytes,
        evaluations=probe.evaluations,
        seconds=time.monotonic() - started,
        stopped_early=stopped_early,
    )


def _in(spec: ModelSpec, table: TableSpec, dtype: WeightDtype) -> TableSpec:
    """``table`` in ``dtype``, or in the smallest dtype wider than it that the table can be served in."""
    ladder = spec.servable_dtypes(table)
    wider = [d for d in ladder if list(WeightDtype).index(d) <= list(WeightDtype).index(dtype)]
    return table.model_copy(update={"weight_dtype": wider[-1] if wider else ladder[0]})
