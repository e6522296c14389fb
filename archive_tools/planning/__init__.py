"""``torchrec-serve plan``: each table's served dtype chosen under an accuracy budget.

    torchrec-serve plan --spec criteo --checkpoint trained.pt --data eval.tsv --max-auc-drop 0.0005

From a spec, its trained float model and labelled data, the planner measures how much each table
loses in each narrower dtype (and, with ``--prune``, with a share of its least used rows pruned:
``choices``), combines the choices that save the most bytes per unit of accuracy (``search``),
checks the result on held-out data as the archive would serve it, and writes ``NAME.planned.yaml``
(build it as any spec), ``NAME.pruning.pt`` (the ids pruned tables keep), ``NAME.plan.json``
(``report``) and ``NAME.plan.png``. All of it runs on the rows the data looks up (``probe``), so a
table's size costs nothing but bytes.

Which rows are least used: ``--counts FILE`` (``{table: int64 [rows]}``, how often training looked
each id up), or else the ids' counts in the first half of the plan split; the second half is then
what the plan is chosen on, so that a pruned row costs there what it will cost on new data.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from archive_tools.planning.choices import Usage, read_counts
from archive_tools.planning.probe import FloatTables, ServedTables, TableProbe, Tables, count_ids, require_labels
from archive_tools.planning.report import plot, planned_spec, report, summary_lines, write_report
from archive_tools.planning.search import Budget, PlanSearch, search
from archive_tools.validation_data import ValidationData, ValidationDataError, read_validation
from handlers.modeling.checkpoint import read_checkpoint
from handlers.modeling.errors import SpecError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.modeling.spec import ModelSpec
from handlers.runtime.errors import InputError

__all__ = [
    "Budget", "FloatTables", "PlanOutputs", "ServedTables", "count_ids", "plan_model", "plan_tables", "split_validation",
    "subset",
]


@dataclasses.dataclass(frozen=True)
class PlanOutputs:
    spec: Path
    pruning: Path | None  # the ids pruned tables keep (None: the plan prunes nothing)
    report: Path
    plot: Path
    search: PlanSearch


def plan_tables(
    spec_path: Path,
    data_path: Path,
    budget: Budget,
    out: Path,
    checkpoint: Path | None = None,
    seed: int = 0,
    holdout_path: Path | None = None,
    holdout_share: float = 0.3,
    max_minutes: float | None = None,
    prune: bool = False,
    counts_path: Path | None = None,
    quantized_init: bool = False,
) -> PlanOutputs:
    """``quantized_init``: seeded random tables made in the spec's dtypes, never in float (a model
    too large to hold in float, as ``build --init quantized``): they are the reference, and each
    table can only be narrowed."""
    spec = load_spec(spec_path)
    if spec.pruning is not None:
        raise SpecError(f"{spec_path}: pruning: plan the unpruned spec (its tables without pruned_to)")
    if spec.raw_id_tables:
        raise SpecError(
            f"{spec_path}: tables {list(spec.raw_id_tables)} take raw ids (ids: raw): the planner measures "
            "tables by the rows ids look up, and is not made for managed collisions yet"
        )
    if counts_path is not None and not prune:
        raise InputError("--counts: the ids' counts choose the rows to prune; add --prune")
    factory = DLRMFactory(spec)
    if quantized_init:
        if checkpoint is not None:
            raise InputError("--init quantized makes random tables; it does not read --checkpoint")
        tables: Tables = ServedTables(spec, factory.random_weights(seed))
    else:
        model = factory.float_model(seed=seed)
        if checkpoint is not None:
            note = factory.load_checkpoint(model, read_checkpoint(checkpoint))
            if note:
                tqdm.write(f"checkpoint {checkpoint}: {note}", file=sys.stderr)
        tables = FloatTables(model)
    data = read_validation(data_path, spec)
    require_labels(data)
    if holdout_path is not None:
        plan_data, holdout = data, read_validation(holdout_path, spec)
    else:
        plan_data, holdout = split_validation(data, holdout_share, seed)
    counts = read_counts(counts_path, spec) if counts_path is not None else None
    return plan_model(spec, tables, plan_data, holdout, budget, out, prune, counts, max_minutes)


def plan_model(
    spec: ModelSpec,
    tables: Tables,
    plan_data: ValidationData,
    holdout: ValidationData,
    budget: Budget,
    out: Path,
    prune: bool = False,
    counts: dict[str, torch.Tensor] | None = None,
    max_minutes: float | None = None,
) -> PlanOutputs:
    """Plans ``spec``'s tables from ``tables`` (a float model's, or as served) on labelled data
    and writes the outputs to ``out``; ``counts``: id counts per table for pruning (default: those
    of the plan split's first half, the second half then being what the plan is chosen on)."""
    require_labels(plan_data)
    require_labels(holdout)
    usage = None
    if prune:
        if counts is None:  # counted on one half, measured on the other: a pruned row costs what it will
            half = len(plan_data.requests) // 2
            if half == 0:
                raise ValidationDataError(f"{plan_data.source}: --prune without --counts needs two requests to plan on")
            counting = subset(plan_data, range(half), "counted")
            plan_data = subset(plan_data, range(half, len(plan_data.requests)), "planned on")
            counts = count_ids(spec, counting)
        usage = Usage(counts)
    probe = TableProbe(spec, tables, {"plan": plan_data, "holdout": holdout})
    max_seconds = None if max_minutes is None else max_minutes * 60
    found = search(spec, probe, budget, usage, max_seconds, widest=tables.widest)
    out.mkdir(parents=True, exist_ok=True)
    pruning = out / f"{spec.name}.pruning.pt"
    planned = planned_spec(spec, found, pruning.name)
    pruning.unlink(missing_ok=True)  # an earlier plan's
    if planned.pruning is not None:
        assert usage is not None  # only a plan with usage prunes
        by_name = {t.name: t for t in spec.tables}
        torch.save({
            name: usage.kept_ids(by_name[name], choice.pruned_share)
            for name, choice in found.planned.choices.items() if choice.pruned_share
        }, pruning)
    outputs = PlanOutputs(
        out / f"{spec.name}.planned.yaml", pruning if planned.pruning else None,
        out / f"{spec.name}.plan.json", out / f"{spec.name}.plan.png", found,
    )
    planned.to_yaml(outputs.spec)
    outputs.spec.write_text(f"# {spec.name}'s tables planned by torchrec-serve plan: see {outputs.report.name}\n"
                            + outputs.spec.read_text())
    rows_in_data = {name: len(ids) for name, ids in probe.used_ids.items()}
    sources = {"plan": plan_data.source, "holdout": holdout.source}
    write_report(report(spec, found, rows_in_data, sources, probe.reference), outputs.report)
    plot(found, outputs.plot, f"{spec.name}: table bytes against accuracy")
    for line in summary_lines(found):
        tqdm.write(line, file=sys.stderr)
    return outputs


def split_validation(data: ValidationData, holdout_share: float, seed: int) -> tuple[ValidationData, ValidationData]:
    """Requests drawn at random (seeded) into a plan split and a held-out one of ``holdout_share``."""
    if not 0 < holdout_share < 1:
        raise InputError(f"--holdout-share: must be between 0 and 1, got {holdout_share}")
    count = len(data.requests)
    held = round(count * holdout_share)
    if held < 1 or held == count:
        raise ValidationDataError(
            f"{data.source}: {count} request(s) cannot be split {1 - holdout_share:.0%}/{holdout_share:.0%}; "
            "give more data or --holdout FILE"
        )
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    return subset(data, sorted(order[held:]), "plan split"), subset(data, sorted(order[:held]), "held out")


def subset(data: ValidationData, indices: Sequence[int], label: str) -> ValidationData:
    """The requests of ``data`` at ``indices``, with their labels and origins."""
    return ValidationData(
        [data.requests[i] for i in indices],
        None if data.labels is None else [data.labels[i] for i in indices],
        f"{data.source} ({label}, {len(indices)} of {len(data.requests)} requests)",
        [data.origins[i] for i in indices],
    )
