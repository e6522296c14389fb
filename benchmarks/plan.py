"""The ``plan`` scenario: the memory planner (``torchrec-serve plan``) on a real click log, and its
planning time at the Criteo 1TB size.

    make bench SCENARIO=plan DATA=/path/to/criteo_sample.tsv

1. **A real click log.** ``DATA`` is a Criteo TSV (label, 13 integer and 26 hex categorical
   fields; Criteo's ``dac_sample.txt``, or any slice of the Display Advertising Challenge's
   ``train.txt``). The first ``TRAIN_SHARE`` of its lines train the Criteo-shaped DLRM
   (``config/models/criteo.yaml``: ids hashed into tables of at most 100k rows); the rest is the
   planner's data, split into a plan split and held-out data. The planner prunes with the ids'
   counts in the training lines.
2. **The Criteo 1TB size.** ``criteo_1tb.yaml`` with every table int8 (11.3 GiB: the widest dtype
   that fits this machine; fp16 would take 22.6 GiB), seeded random tables made in int8: they are
   the reference, as no float model fits. Labelled requests are generated from the spec (clicks
   drawn from the reference's own scores) and the planner runs with pruning, timed.

Writes ``benchmarks/results/plan/plan.json``: from the click log ``budget_auc_drop``,
``float_auc`` (held out), ``planned_auc_holdout``, ``planned_table_bytes``, ``best_uniform_dtype``,
``best_uniform_table_bytes``, ``bytes_ratio`` (planned / best uniform), ``pruned_rows``,
``plan_s`` (the whole ``plan_model``: probe, search, outputs); from the 1TB size
``plan_s_criteo_1tb`` (the same, from int8 tables in memory) and its figures under ``criteo_1tb``; with
each run's own report and plot beside it (``real/``, ``criteo_1tb/``) and ``summary.txt``.
Targets: ``bytes_ratio`` at most 0.7 at an AUC drop of at most 0.0005 on held-out data; the 1TB
plan in at most 15 minutes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import orjson
import torch
from tqdm import tqdm

from archive_tools.planning import (
    Budget, FloatTables, PlanOutputs, ServedTables, count_ids, plan_model, split_validation, subset,
)
from archive_tools.validation_data import ValidationData, read_validation
from archive_tools.verification import generated_validation
from handlers.modeling.eager import EagerModel, eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema, load_spec
from handlers.modeling.spec import WeightDtype
from handlers.runtime.batching import coalesce
from handlers.runtime.wire.decoder import RequestDecoder
from benchmarks.scenarios import MODELS

PLAN_SCENARIOS = ("plan",)
BUDGET = Budget(max_auc_drop=0.0005, max_ne_increase=0.002)
TRAIN_SHARE = 0.6  # of the click log's lines, for training; the rest is the planner's
EPOCHS = 4
TARGET_BYTES_RATIO = 0.7
TARGET_PLAN_MINUTES_1TB = 15.0
REQUESTS_1TB, ITEMS_1TB = 256, 32  # generated labelled data at the 1TB size


def run_plan(out_dir: Path, data: Path | None) -> dict:
    if data is None:
        raise SystemExit(
            "plan: give a click log, a Criteo TSV: make bench SCENARIO=plan DATA=FILE (see benchmarks/README.md)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    real, real_s = _real_click_log(data, out_dir / "real")
    big, big_s = _criteo_1tb(out_dir / "criteo_1tb")
    real_report = orjson.loads(real.report.read_bytes())
    big_report = orjson.loads(big.report.read_bytes())
    best = real_report["best_uniform"]
    results = {
        "scenario": "plan",
        "data": str(data),
        "budget_auc_drop": BUDGET.max_auc_drop,
        "float_auc": real_report["reference"]["holdout"]["auc"],
        "planned_auc_holdout": real_report["planned"]["holdout"]["auc"],
        "planned_table_bytes": real_report["planned"]["table_bytes"],
        "best_uniform_dtype": None if best is None else best["label"].removeprefix("all "),
        "best_uniform_table_bytes": None if best is None else best["table_bytes"],
        "bytes_ratio": real_report["bytes_ratio_to_best_uniform"],
        "pruned_rows": real_report["pruned_rows"],
        "plan_s": real_s,
        "plan_s_criteo_1tb": big_s,
        "real": _figures(real_report),
        "criteo_1tb": _figures(big_report),
    }
    drop = real_report["planned"]["auc_drop"]
    results["targets"] = [
        _target(f"bytes_ratio <= {TARGET_BYTES_RATIO} at AUC drop <= {BUDGET.max_auc_drop} (held out: {drop:.2e})",
                results["bytes_ratio"], TARGET_BYTES_RATIO, drop <= BUDGET.max_auc_drop),
        _target(f"Criteo 1TB size planned in <= {TARGET_PLAN_MINUTES_1TB:g} min, every move tried", big_s / 60,
                TARGET_PLAN_MINUTES_1TB, not big_report["stopped_early"]),
    ]
    (out_dir / "plan.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    lines = _summary(results)
    (out_dir / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


def _real_click_log(path: Path, out: Path) -> tuple[PlanOutputs, float]:
    """The plan of a DLRM trained on the click log's first lines, and how long planning took."""
    spec = load_spec(MODELS / "criteo.yaml")
    data = read_validation(path, spec)
    cut = round(len(data.requests) * TRAIN_SHARE)
    training, planning = subset(data, range(cut), "training"), subset(data, range(cut, len(data.requests)), "planning")
    model = _train(spec, training)
    plan_data, holdout = split_validation(planning, 0.3, seed=0)
    counts = count_ids(spec, training)  # how often training looked each id up
    started = time.perf_counter()
    outputs = plan_model(spec, FloatTables(model), plan_data, holdout, BUDGET, out, prune=True, counts=counts)
    return outputs, time.perf_counter() - started


def _criteo_1tb(out: Path) -> tuple[PlanOutputs, float]:
    """The plan of the 1TB-size model from int8 tables, and how long planning took (from the
    tables and data in memory to the written outputs)."""
    shipped = load_spec(MODELS / "criteo_1tb.yaml")
    spec = shipped.replace(tables=[t.model_copy(update={"weight_dtype": WeightDtype.INT8}) for t in shipped.tables])
    factory = DLRMFactory(spec)
    started = time.perf_counter()
    weights = factory.random_weights(seed=0)
    reference = eager_service(spec, factory.inference_model(weights))
    data = generated_validation(spec, reference, REQUESTS_1TB, ITEMS_1TB, seed=0)
    tqdm.write(f"criteo_1tb: int8 tables and {REQUESTS_1TB * ITEMS_1TB} labelled items in "
               f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    del reference
    plan_data, holdout = split_validation(data, 0.3, seed=0)
    started = time.perf_counter()
    outputs = plan_model(spec, ServedTables(spec, weights), plan_data, holdout, BUDGET, out, prune=True,
                         max_minutes=TARGET_PLAN_MINUTES_1TB)
    return outputs, time.perf_counter() - started


def _train(spec, data: ValidationData) -> torch.nn.Module:
    """The float DLRM after ``EPOCHS`` passes over ``data``'s requests (one per step): SGD on
    the tables, Adam on the dense layers."""
    torch.manual_seed(0)
    model = DLRMFactory(spec).float_model(seed=0).train()
    schema = input_schema(spec)
    decoder = RequestDecoder(schema)
    runner = EagerModel(model, schema.tags)
    batches = [coalesce([decoder.decode(r).inputs], schema.tags) for r in data.requests]
    labels = [torch.tensor(y, dtype=torch.float32) for y in data.labels or []]
    tables = [p for name, p in model.named_parameters() if ".embedding_bags." in name]
    dense = [p for name, p in model.named_parameters() if ".embedding_bags." not in name]
    optimizers = [torch.optim.SGD(tables, lr=0.5), torch.optim.Adam(dense, lr=1e-3)]
    for _ in tqdm(range(EPOCHS), desc="plan: train the DLRM", unit="epoch"):
        for batch, y in zip(batches, labels):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(runner(batch).reshape(-1), y)
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
    return model.eval()


def _figures(report: dict) -> dict:
    return {
        "reference": report["reference"]["model"],
        "planned": report["planned"],
        "best_uniform": report["best_uniform"],
        "bytes_ratio": report["bytes_ratio_to_best_uniform"],
        "pruned_rows": report["pruned_rows"],
        "tables": {t["name"]: {"dtype": t["dtype"], "pruned_share": t["pruned_share"]} for t in report["tables"]},
        "evaluations": report["evaluations"],
        "seconds": report["seconds"],
        "stopped_early": report["stopped_early"],
    }


def _target(label: str, measured: float | None, bound: float, condition: bool) -> dict:
    met = measured is not None and measured <= bound and condition
    return {"target": label, "measured": measured, "op": "<=", "bound": bound, "met": met}


def _summary(results: dict) -> list[str]:
    real, big = results["real"], results["criteo_1tb"]
    lines = [
        f"plan: click log {results['data']}",
        f"  float AUC {results['float_auc']:.4f} held out; planned {results['planned_auc_holdout']:.4f} "
        f"(drop {real['planned']['auc_drop']:.2e}, budget {results['budget_auc_drop']})",
        f"  tables {results['planned_table_bytes'] / 2**20:.1f} MiB planned vs "
        f"{(results['best_uniform_table_bytes'] or 0) / 2**20:.1f} MiB for the best uniform dtype "
        f"({results['best_uniform_dtype']}): ratio {results['bytes_ratio']}",
        f"  {results['pruned_rows']:,} rows pruned; planned in {results['plan_s']:.0f} s (search {real['seconds']:.0f} s)",
        f"criteo_1tb (reference: {big['reference']})",
        f"  planned {big['planned']['table_bytes'] / 2**30:.2f} GiB, ratio {big['bytes_ratio']} to the best "
        f"uniform dtype; {big['pruned_rows']:,} rows pruned; planned in {results['plan_s_criteo_1tb']:.0f} s "
        f"(search {big['seconds']:.0f} s)",
    ]
    lines += [f"  {'met' if t['met'] else 'MISSED'}: {t['target']} (measured {t['measured']})" for t in results["targets"]]
    return lines
