"""What a plan leaves behind: the planned spec, a JSON report and a plot of bytes against accuracy.

``NAME.plan.json``::

    {"budget": {"max_auc_drop": 0.0005, "max_ne_increase": 0.002},
     "reference": {"model": "the float model", "plan": {"auc": ..., "log_loss": ..., "ne": ...},
                   "holdout": {...}},
     "planned": {"table_bytes": ..., "auc_drop": ..., "auc_drop_ci95": [low, high], "ne_increase": ...,
                 "max_abs_score_diff": ..., "within_budget": true, "pruning_saved_bytes": ...},
     "best_uniform": {"label": "all int8", "table_bytes": ..., ...},   # null when none meets the budget
     "pruned_rows": 270,
     "tables": [{"name": "t_user", "rows": 1000, "dim": 8, "rows_in_data": 731,
                 "dtype_given": "int8", "dtype": "int4", "pruned_share": 0.25, "pruned_rows": 250,
                 "bytes_given": ..., "bytes": ...,
                 "alone": {"fp16": {"auc_drop": ..., "ne_increase": ...},
                           "fp32, 50% of rows pruned": {...}, ...}}, ...],
     "uniform": [...], "moves": [...], "backed_off": [...], "combined": {...}, "superseded": [...],
     "evaluations": 93, "seconds": 41.2}

``moves`` are the plan's (kept on the held-out data); ``backed_off`` those the held-out data
refused; ``combined`` what the kept moves reach, and ``superseded`` those moves where a uniform
dtype saves more and is the plan. ``auc_drop_ci95`` is the paired bootstrap 95% interval of the
held-out AUC drop (the same rows resampled for both models); ``pruning_saved_bytes`` what the
point's pruned rows save against the same dtypes unpruned.

AUC drops and NE increases are against the reference on the held-out data (``alone``: on the plan
split); a negative drop is a gain. The reference is the float model, or for a model too large to
hold in float (``--init quantized``) its tables as the given spec serves them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
import orjson  # noqa: E402

from archive_tools.planning.choices import Choice, pruned_rows  # noqa: E402
from archive_tools.planning.search import Move, PlanSearch, Point  # noqa: E402
from archive_tools.summary import human_size  # noqa: E402
from archive_tools.verification import Quality  # noqa: E402
from handlers.modeling.spec import ModelSpec  # noqa: E402

MIB = 2**20


def planned_spec(spec: ModelSpec, found: PlanSearch, pruning: str | None) -> ModelSpec:
    """The spec with the plan's choices: each table's dtype and, pruned, its ``pruned_to`` (the
    kept ids in the file ``pruning``, relative to the spec)."""
    tables = []
    for t in spec.tables:
        choice = found.planned.choices[t.name]
        kept = t.rows - pruned_rows(t, choice.pruned_share) if choice.pruned_share else None
        tables.append(t.model_copy(update={"weight_dtype": choice.dtype, "pruned_to": kept}))
    return spec.replace(tables=tables, pruning=pruning if any(t.pruned_to for t in tables) else None)


def best_uniform(found: PlanSearch) -> Point | None:
    """The uniform dtype with the fewest table bytes that meets the budget on held-out data."""
    return min((p for p in found.uniform if p.within_budget), key=lambda p: p.table_bytes, default=None)


def report(
    spec: ModelSpec, found: PlanSearch, rows_in_data: dict[str, int], sources: dict[str, str], reference: str
) -> dict[str, Any]:
    sizes = {t.name: t for t in spec.tables}
    best = best_uniform(found)
    return {
        "spec": spec.name,
        "budget": {"max_auc_drop": found.budget.max_auc_drop, "max_ne_increase": found.budget.max_ne_increase},
        "data": sources,
        "reference": {"model": reference, "plan": _quality(found.float_plan), "holdout": _quality(found.float_holdout)},
        "planned": _point(found, found.planned),
        "given": _point(found, found.given),
        "best_uniform": None if best is None else _point(found, best),
        "bytes_ratio_to_best_uniform": None if best is None else found.planned.table_bytes / best.table_bytes,
        "pruned_rows": sum(pruned_rows(sizes[n], c.pruned_share) for n, c in found.planned.choices.items()),
        "tables": [
            {
                "name": name,
                "rows": sizes[name].rows,
                "dim": sizes[name].dim,
                "rows_in_data": rows_in_data[name],
                "dtype_given": found.given.choices[name].dtype.value,
                "dtype": choice.dtype.value,
                "pruned_share": choice.pruned_share,
                "pruned_rows": pruned_rows(sizes[name], choice.pruned_share),
                "bytes_given": found.sizes.of_table(name, found.given.choices[name]),
                "bytes": found.sizes.of_table(name, choice),
                "alone": {c.label: _change(found.float_plan, q) for (table, c), q in found.alone.items() if table == name},
            }
            for name, choice in found.planned.choices.items()
        ],
        "uniform": [_point(found, p) for p in found.uniform],
        "moves": [_move(found, m) for m in found.moves],
        "backed_off": [_move(found, m) for m in found.backed_off],
        "combined": _point(found, found.combined),
        "superseded": [_move(found, m) for m in found.superseded],
        "evaluations": found.evaluations,
        "seconds": found.seconds,
        "stopped_early": found.stopped_early,
    }


def summary_lines(found: PlanSearch) -> list[str]:
    planned, best = found.planned, best_uniform(found)
    lines = [f"  {'table':<24}{'given':>7}{'planned':>9}{'pruned':>8}{'bytes':>12}"]
    lines += [
        f"  {name:<24}{found.given.choices[name].dtype.value:>7}{choice.dtype.value:>9}"
        f"{choice.pruned_share:>8.0%}{human_size(found.sizes.of_table(name, choice)):>12}"
        for name, choice in planned.choices.items()
    ]
    change = _change(found.float_holdout, planned.holdout)
    lines.append(
        f"planned: {human_size(planned.table_bytes)} of tables (given spec {human_size(found.given.table_bytes)}); "
        f"on held-out data AUC drop "
        f"{change['auc_drop']:.2e} (budget {found.budget.max_auc_drop:g}), NE increase "
        f"{change['ne_increase']:.2e} (budget {found.budget.max_ne_increase:g}); scores move by up to "
        f"{planned.max_abs_score_diff:.2e}"
    )
    if best is not None:
        lines.append(
            f"best uniform dtype meeting the budget: {best.label} ({human_size(best.table_bytes)}); "
            f"the plan is {planned.table_bytes / best.table_bytes:.2f}x its bytes"
        )
    else:
        lines.append("no uniform dtype meets the budget on the held-out data")
    if not planned.within_budget:
        lines.append("the budget does not hold even with every table at its widest dtype (dense precision?)")
    low, high = planned.auc_drop_ci95
    lines.append(f"held-out AUC drop's paired bootstrap 95% interval: [{low:.2e}, {high:.2e}]")
    if found.backed_off:
        lines.append(f"backed off {len(found.backed_off)} move(s) the held-out data did not bear")
    if planned.label != "plan":
        lines.append(f"the moves kept the budget in more bytes than one dtype for every table: {planned.label}")
    if found.stopped_early:
        lines.append("stopped at --max-minutes: some moves were not tried")
    return lines


def plot(found: PlanSearch, path: Path, title: str) -> None:
    """Table bytes against the AUC drop and the NE increase on held-out data: each uniform dtype,
    the given spec and the plan, with the budget; each AUC drop with its bootstrap 95% interval."""
    figure, panels = plt.subplots(1, 2, figsize=(11, 4.5))
    reference = found.float_holdout
    for axes, key, bound in (
        (panels[0], "auc_drop", found.budget.max_auc_drop),
        (panels[1], "ne_increase", found.budget.max_ne_increase),
    ):
        for point in found.uniform:
            x, y = point.table_bytes / MIB, _change(reference, point.holdout)[key]
            axes.plot(x, y, "o", color="tab:blue", markersize=7)
            axes.annotate(point.label, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        for point, style, color in ((found.given, "s", "tab:gray"), (found.planned, "*", "tab:red")):
            axes.plot(point.table_bytes / MIB, _change(reference, point.holdout)[key], style, color=color,
                      markersize=14 if style == "*" else 9, label=point.label, alpha=0.8)
        if key == "auc_drop":
            for point, color in [(p, "tab:blue") for p in found.uniform] + [(found.given, "tab:gray"), (found.planned, "tab:red")]:
                y, (low, high) = _change(reference, point.holdout)[key], point.auc_drop_ci95
                axes.errorbar(point.table_bytes / MIB, y, yerr=[[max(0.0, y - low)], [max(0.0, high - y)]], color=color,
                              capsize=4, linewidth=1, label="95% interval (paired bootstrap)" if point is found.planned else None)
        axes.axhline(bound, linestyle="--", color="tab:red", linewidth=1, label="budget")
        axes.set_xscale("log")
        axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        axes.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: f"{x:g}" if f"{x:g}"[0] in "25" else ""))
        axes.set_xlabel("table bytes (MiB, log scale)")
        axes.set_ylabel(f"{key.replace('_', ' ').replace('ne', 'NE').replace('auc', 'AUC')} vs float, held-out data")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8, loc="upper right")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(data: dict[str, Any], path: Path) -> None:
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))


def _point(found: PlanSearch, point: Point) -> dict[str, Any]:
    return {
        "label": point.label,
        "table_bytes": point.table_bytes,
        **_change(found.float_holdout, point.holdout),
        "auc_drop_ci95": list(point.auc_drop_ci95),
        "max_abs_score_diff": point.max_abs_score_diff,
        "holdout": _quality(point.holdout),
        "within_budget": point.within_budget,
        "pruning_saved_bytes": sum(
            found.sizes.of_table(name, Choice(c.dtype)) - found.sizes.of_table(name, c) for name, c in point.choices.items()
        ),
    }


def _move(found: PlanSearch, move: Move) -> dict[str, Any]:
    """A move, what it saved, and the plan split's change once it was taken."""
    return {"table": move.table, "from": move.before.label, "to": move.after.label, "saved_bytes": move.saved_bytes,
            **_change(found.float_plan, move.plan_quality)}


def _change(reference: Quality, measured: Quality) -> dict[str, float]:
    return {"auc_drop": reference.auc - measured.auc, "ne_increase": measured.ne - reference.ne}


def _quality(quality: Quality) -> dict[str, float]:
    return {"auc": quality.auc, "log_loss": quality.log_loss, "ne": quality.ne}
