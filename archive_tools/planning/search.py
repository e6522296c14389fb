"""Choosing each table's dtype (and, with ``usage``, a share of its rows to prune) under a budget.

1. **Sensitivity.** Each table alone in each narrower dtype it can be served in (``fp16``,
   ``int8``, ``int4``, ``int2``), and alone with each share of its least used rows pruned, every
   other table float: its AUC drop and NE increase on the plan split. ``Budget.cost`` turns both
   into one number: 1.0 spends the whole budget. A dtype and a pruning together are predicted to
   cost what the two cost alone.
2. **Combine.** From all tables float, repeatedly take the move (one table to a choice with fewer
   bytes) that saves the most bytes per unit of cost measured alone, and measure the combination;
   keep it if the plan split stays within ``PLAN_SHARE`` of the budget, else rule out that choice
   and every choice beyond it for the table. Every move either lowers a table or rules choices
   out, so this ends.
3. **Hold out.** The combination, as the served model computes it (``TableProbe.served_quality``),
   on data it was not chosen on; while it breaks the budget, the last move taken is undone.

The uniform dtypes (every table in one dtype, unpruned) are measured the same way, for comparison;
where one of them keeps the budget in fewer bytes than the combination, it is the plan (the moves
are then ``superseded``, not the plan's). Each held-out point carries a paired bootstrap interval
of its AUC drop (``uncertainty``): what the held-out rows can resolve.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping

import torch
from tqdm import tqdm

from archive_tools.planning.choices import Choice, TableBytes, Usage, in_dtype, no_wider, options, pruned_rows
from archive_tools.planning.probe import TableProbe
from archive_tools.verification import Quality
from handlers.modeling.spec import ModelSpec, WeightDtype

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
    before: Choice
    after: Choice
    saved_bytes: int
    plan_quality: Quality  # of the whole combination once the move was taken


@dataclasses.dataclass(frozen=True)
class Point:
    """One choice per table: the tables' bytes and the served quality on held-out data."""

    label: str
    choices: dict[str, Choice]
    table_bytes: int
    holdout: Quality
    max_abs_score_diff: float  # from the float model's scores, on held-out data
    within_budget: bool
    auc_drop_ci95: tuple[float, float]  # paired bootstrap interval of the held-out AUC drop


@dataclasses.dataclass(frozen=True)
class PlanSearch:
    budget: Budget
    float_plan: Quality
    float_holdout: Quality
    alone: dict[tuple[str, Choice], Quality]  # one table in one dtype, or pruned, on the plan split
    moves: list[Move]  # the plan's, in order: taken and kept on the held-out data (none if a uniform dtype won)
    backed_off: list[Move]  # undone on the held-out data, last first
    combined: Point  # what the moves kept reach, as checked on the held-out data
    superseded: list[Move]  # moves kept on the held-out data, but a uniform dtype saves more: not in the plan
    planned: Point
    given: Point
    uniform: list[Point]
    sizes: TableBytes
    evaluations: int
    seconds: float
    stopped_early: bool  # --max-minutes ran out before every move was tried


class _Settings:
    """Choices -> what the probe takes: dtypes, and the probe rows of pruned ids (cached)."""

    def __init__(self, spec: ModelSpec, probe: TableProbe, usage: Usage | None) -> None:
        self.tables = {t.name: t for t in spec.tables}
        self.probe = probe
        self.usage = usage
        self._zeroed: dict[tuple[str, float], torch.Tensor] = {}

    def __call__(self, choices: dict[str, Choice]) -> tuple[dict[str, WeightDtype], dict[str, torch.Tensor]]:
        dtypes = {name: c.dtype for name, c in choices.items()}
        return dtypes, {name: self.zeroed(name, c.pruned_share) for name, c in choices.items() if c.pruned_share}

    def zeroed(self, name: str, share: float) -> torch.Tensor:
        """bool [probe rows]: the rows of ids that ``share`` prunes from the table."""
        if (name, share) not in self._zeroed:
            assert self.usage is not None  # only pruned choices ask
            table, used = self.tables[name], self.probe.used_ids[name]
            probe_rows = next(t.rows for t in self.probe.compact_spec.tables if t.name == name)  # 1 if no id is used
            zeroed = torch.zeros(probe_rows, dtype=torch.bool)
            zeroed[: len(used)] = self.usage.ranks(name, used) >= table.rows - pruned_rows(table, share)
            self._zeroed[(name, share)] = zeroed
        return self._zeroed[(name, share)]


def search(
    spec: ModelSpec,
    probe: TableProbe,
    budget: Budget,
    usage: Usage | None = None,
    max_seconds: float | None = None,
    progress: Callable[..., tqdm] = tqdm,
    widest: Mapping[str, WeightDtype] = {},
) -> PlanSearch:
    """``usage``: which rows are least used, for pruning (None: no table is pruned); ``widest``:
    per table the widest dtype to consider (the reference's, where it is not float)."""
    started = time.monotonic()
    out_of_time = lambda: max_seconds is not None and time.monotonic() - started > max_seconds  # noqa: E731
    sizes = TableBytes(spec)
    settings = _Settings(spec, probe, usage)
    prunable = usage.tables() if usage is not None else set()
    offered = {
        t.name: options(spec, t, t.name in prunable, widest.get(t.name, WeightDtype.FP32)) for t in spec.tables
    }
    top = {name: choices[0] for name, choices in offered.items()}
    float_plan = probe.quality("plan", {})

    alone: dict[tuple[str, Choice], Quality] = {}
    steps = [  # every narrower dtype unpruned, every pruned share in the widest dtype
        (name, c) for name, choices in offered.items() for c in choices[1:]
        if c.dtype == top[name].dtype or not c.pruned_share
    ]
    for name, choice in progress(steps, desc="plan: each table alone", unit="eval"):
        if out_of_time():
            break
        alone[(name, choice)] = probe.quality("plan", *settings({name: choice}))
    stopped_early = len(alone) < len(steps)

    def alone_cost(name: str, choice: Choice) -> float | None:
        """The choice's predicted cost: its dtype's alone plus its pruning's alone (None: not measured)."""
        total = 0.0
        for part in (Choice(choice.dtype), Choice(top[name].dtype, choice.pruned_share)):
            if part != top[name]:
                if (name, part) not in alone:
                    return None
                total += budget.cost(float_plan, alone[(name, part)])
        return total

    current = dict(top)
    moves: list[Move] = []
    failed: dict[str, list[Choice]] = {name: [] for name in offered}
    bar = progress(desc="plan: combine", unit="eval", total=None)
    while not out_of_time():
        candidates = []
        for name, choices in offered.items():
            now, cost_now = current[name], alone_cost(name, current[name])
            for choice in choices:
                if choice == now or not choice.beyond(now) or any(choice.beyond(f) for f in failed[name]):
                    continue
                saved = sizes.of_table(name, now) - sizes.of_table(name, choice)
                cost = alone_cost(name, choice)
                if saved <= 0 or cost is None or cost_now is None:  # row alignment: a narrower dtype may be no smaller
                    continue
                candidates.append((saved / max(cost - cost_now, _FREE), saved, name, choice))
        if not candidates:
            break
        _, saved, name, choice = max(candidates, key=lambda c: (c[0], c[1]))
        trial = {**current, name: choice}
        measured = probe.quality("plan", *settings(trial))
        bar.update()
        if budget.cost(float_plan, measured) <= PLAN_SHARE:
            moves.append(Move(name, current[name], choice, saved, measured))
            current = trial
        else:
            failed[name].append(choice)
    stopped_early = stopped_early or out_of_time()
    bar.close()

    float_holdout = probe.quality("holdout", {})  # the float model: what the build's gate compares with

    def point(label: str, choices: dict[str, Choice]) -> Point:
        served = probe.served_quality("holdout", *settings(choices))
        within = budget.cost(float_holdout, served.quality) <= 1.0
        return Point(label, dict(choices), sizes.of(choices), served.quality, served.max_abs_score_diff, within,
                     served.auc_drop_ci95)

    backed_off: list[Move] = []
    planned = point("plan", current)
    while not planned.within_budget and moves:
        undone = moves.pop()
        backed_off.append(undone)
        current = {**current, undone.table: undone.before}
        planned = point("plan", current)
    narrow_enough = [d for d in WeightDtype if all(no_wider(d, than=w) for w in widest.values())]
    uniform = [
        point(f"all {dtype.value}", {t.name: Choice(in_dtype(spec, t, dtype).weight_dtype) for t in spec.tables})
        for dtype in progress(narrow_enough, desc="plan: uniform dtypes", unit="dtype")
    ]
    given = point("given spec", {t.name: Choice(t.weight_dtype) for t in spec.tables})
    combined, superseded = planned, []
    smaller = [p for p in uniform if p.within_budget and p.table_bytes < planned.table_bytes]
    if smaller:  # the moves did not beat one dtype for every table: that is the plan
        best = min(smaller, key=lambda p: p.table_bytes)
        planned = dataclasses.replace(best, label=f"plan ({best.label})")
        moves, superseded = [], moves
    return PlanSearch(
        budget=budget,
        float_plan=float_plan,
        float_holdout=float_holdout,
        alone=alone,
        moves=moves,
        backed_off=backed_off,
        combined=combined,
        superseded=superseded,
        planned=planned,
        given=given,
        uniform=uniform,
        sizes=sizes,
        evaluations=probe.evaluations,
        seconds=time.monotonic() - started,
        stopped_early=stopped_early,
    )
