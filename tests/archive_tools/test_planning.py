"""The planner: on a model trained on clicks with a known structure (``planning_model``), it gives the
noise tables the smallest dtype, keeps the budget on held-out data as the served model computes it,
and writes a spec the build accepts under the same budget."""

import orjson
import pytest
import torch

from archive_tools.build import build_archive
from archive_tools.cli import main
from archive_tools.model_config import ServingConfig
from archive_tools.planning import split_validation
from archive_tools.planning.uncertainty import auc_drop_interval
from archive_tools.validation_data import read_validation
from archive_tools.verification import Bounds, verify
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema, load_spec
from handlers.modeling.spec import WeightDtype
from handlers.runtime.wire.decoder import RequestDecoder
from tests.archive_tools.planning_model import NOISE, SIGNAL, Clicks, planning_spec, train

AUC_BUDGET, NE_BUDGET = 0.0005, 0.002


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    spec = planning_spec()
    spec.to_yaml(folder / "spec.yaml")
    model = train(spec, Clicks(40_000, seed=1))
    torch.save(model.state_dict(), folder / "trained.pt")
    Clicks(16_000, seed=2).write_jsonl(folder / "clicks.jsonl")
    code = main([
        "plan", "--spec", str(folder / "spec.yaml"), "--checkpoint", str(folder / "trained.pt"),
        "--data", str(folder / "clicks.jsonl"), "--max-auc-drop", str(AUC_BUDGET),
        "--max-ne-increase", str(NE_BUDGET), "--out", str(folder / "out"),
    ])
    assert code == 0
    return folder, model, orjson.loads((folder / "out" / "planned.plan.json").read_bytes())


def test_noise_tables_get_the_smallest_dtype_and_signal_tables_keep_more_bits(planned):
    folder, _, _ = planned
    dtypes = {t.name: t.weight_dtype for t in load_spec(folder / "out" / "planned.planned.yaml").tables}
    assert all(dtypes[name] == WeightDtype.INT2 for name in NOISE), dtypes
    assert all(dtypes[name] != WeightDtype.INT2 for name in SIGNAL), dtypes


def test_the_served_plan_keeps_the_budget_on_the_held_out_data_and_all_int2_does_not(planned):
    """Independently of the planner: the planned spec's model, quantized by the factory from the
    trained checkpoint, on the held-out requests (the same seeded split) against the float model."""
    folder, model, report = planned
    spec = planning_spec()
    _, holdout = split_validation(read_validation(folder / "clicks.jsonl", spec), 0.3, seed=0)
    bounds = Bounds(max_abs_score_diff=1.0, max_auc_drop=AUC_BUDGET, max_ne_increase=NE_BUDGET)
    reference = eager_service(spec, model)

    def served(planned_spec):
        factory = DLRMFactory(planned_spec)
        return eager_service(planned_spec, factory.inference_model(factory.quantize(model)))

    plan_spec = load_spec(folder / "out" / "planned.planned.yaml")
    checked = verify(served(plan_spec), reference, holdout, bounds)
    assert checked.passed, checked.failures
    drop = checked.reference.auc - checked.served.auc
    assert drop == pytest.approx(report["planned"]["auc_drop"], abs=1e-5)
    labels = torch.tensor([y for request in holdout.labels for y in request])
    interval = auc_drop_interval(_scores(reference, spec, holdout), _scores(served(plan_spec), spec, holdout), labels)
    assert report["planned"]["auc_drop_ci95"] == pytest.approx(list(interval), abs=1e-6)  # the same rows, paired
    low, high = report["planned"]["auc_drop_ci95"]
    assert low < drop < high
    assert checked.max_abs_score_diff == pytest.approx(report["planned"]["max_abs_score_diff"], rel=1e-3)
    all_int2 = spec.replace(tables=[t.model_copy(update={"weight_dtype": WeightDtype.INT2}) for t in spec.tables])
    assert not verify(served(all_int2), reference, holdout, bounds).passed  # the budget binds


def _scores(service, spec, data):
    """Click probabilities [items] of ``data``'s requests, one request per forward."""
    decoder = RequestDecoder(input_schema(spec))
    return torch.sigmoid(torch.cat([torch.cat(service.logits([decoder.decode(r).inputs])) for r in data.requests]))


def _assert_the_moves_are_the_plans(report):
    """The report's moves, replayed from every table in fp32, give the planned tables; a plan that
    is a uniform dtype lists none (what the moves reached is under combined and superseded)."""
    planned = {t["name"]: t["dtype"] + (f", {t['pruned_share']:.0%} of rows pruned" if t["pruned_share"] else "")
               for t in report["tables"]}
    if report["planned"]["label"] != "plan":
        assert report["moves"] == [], report["moves"]
        return
    replayed = {name: "fp32" for name in planned}
    for move in report["moves"]:
        assert replayed[move["table"]] == move["from"]
        replayed[move["table"]] = move["to"]
    assert replayed == planned
    assert report["combined"]["table_bytes"] == report["planned"]["table_bytes"] and report["superseded"] == []


def test_the_plan_takes_fewer_bytes_than_the_best_uniform_dtype(planned):
    _, _, report = planned
    _assert_the_moves_are_the_plans(report)
    best = report["best_uniform"]
    assert best["label"] == "all int4" and best["within_budget"]
    assert report["planned"]["table_bytes"] < best["table_bytes"]
    assert report["bytes_ratio_to_best_uniform"] == report["planned"]["table_bytes"] / best["table_bytes"]
    by_name = {t["name"]: t for t in report["tables"]}
    assert set(by_name) == set(SIGNAL + NOISE)
    assert sum(t["bytes"] for t in by_name.values()) == report["planned"]["table_bytes"]
    assert by_name["t_ad"]["alone"]["int2"]["ne_increase"] > NE_BUDGET  # why the signal stays wider
    assert (folder_png := planned[0] / "out" / "planned.plan.png").stat().st_size > 10_000, folder_png


def test_the_build_gate_accepts_the_planned_spec_under_the_same_budget(planned, tmp_path):
    folder, _, report = planned
    archive = build_archive(
        folder / "out" / "planned.planned.yaml", checkpoint=folder / "trained.pt", seed=0, name="planned",
        version="1.0", model_store=tmp_path, serving=ServingConfig(), validation=folder / "clicks.jsonl",
        bounds=Bounds(max_abs_score_diff=1.5 * report["planned"]["max_abs_score_diff"],
                      max_auc_drop=AUC_BUDGET, max_ne_increase=NE_BUDGET),
    )
    assert archive.exists()


def test_with_no_time_for_moves_the_plan_is_the_best_uniform_dtype(planned, tmp_path):
    folder, _, _ = planned
    code = main([
        "plan", "--spec", str(folder / "spec.yaml"), "--checkpoint", str(folder / "trained.pt"),
        "--data", str(folder / "clicks.jsonl"), "--max-minutes", "0", "--out", str(tmp_path),
    ])
    report = orjson.loads((tmp_path / "planned.plan.json").read_bytes())
    assert code == 0 and report["stopped_early"] and report["moves"] == []
    _assert_the_moves_are_the_plans(report)
    assert report["planned"]["label"] == f"plan ({report['best_uniform']['label']})"
    assert {t["dtype"] for t in report["tables"]} == {report["best_uniform"]["label"].removeprefix("all ")}


@pytest.mark.parametrize(
    "change, code, message",
    [
        (["--max-auc-drop", "0"], 2, "a budget must be above 0"),
        (["--data", "UNLABELLED"], 5, "planning needs labels"),
        (["--holdout-share", "0.9999"], 5, "cannot be split"),
        (["--holdout-share", "1.5"], 2, "--holdout-share: must be between 0 and 1"),
        (["--counts", "COUNTS"], 2, "--counts: the ids' counts choose the rows to prune; add --prune"),
        (["--prune", "--counts", "COUNTS"], 5, "t_ad: counts must be integers [400] (one per id)"),
        (["--prune", "--counts", "NOT_A_TABLE"], 5, "t_nowhere: not a table of planned"),
    ],
)
def test_a_plan_that_cannot_run_says_why(planned, tmp_path, capsys, change, code, message):
    folder, _, _ = planned
    files = {"UNLABELLED": tmp_path / "unlabelled.jsonl", "COUNTS": tmp_path / "counts.pt", "NOT_A_TABLE": tmp_path / "other.pt"}
    files["UNLABELLED"].write_bytes(b'{"items": [{"dense": [0.1, 0.2], "sparse": {"ad": [1], "user": [2], "noise_a": [3], "noise_b": [4]}}]}\n')
    torch.save({"t_ad": torch.zeros(3)}, files["COUNTS"])  # floats, and not one per id
    torch.save({"t_nowhere": torch.zeros(3, dtype=torch.int64)}, files["NOT_A_TABLE"])
    arguments = ["--spec", str(folder / "spec.yaml"), "--data", str(folder / "clicks.jsonl"), "--out", str(tmp_path)]
    arguments += [str(files[a]) if a in files else a for a in change]  # a later --data replaces the first
    assert main(["plan", *arguments]) == code
    assert message in capsys.readouterr().err


def test_pruning_drops_the_noise_tables_rows_and_the_served_pruned_plan_keeps_the_budget(planned, tmp_path):
    """--prune, with counts from training: the noise tables lose most rows, the signal tables
    (whose every id moves the click) keep theirs; built from the planned spec and its kept-ids
    file by the factory, the model keeps the budget on the held-out requests."""
    folder, model, _ = planned
    spec = planning_spec()
    training = Clicks(40_000, seed=1)
    counts = {name: torch.bincount(torch.from_numpy(training.ids[name[2:]]), minlength=t.rows)
              for t in spec.tables for name in [t.name]}
    torch.save(counts, tmp_path / "counts.pt")
    code = main([
        "plan", "--spec", str(folder / "spec.yaml"), "--checkpoint", str(folder / "trained.pt"),
        "--data", str(folder / "clicks.jsonl"), "--max-auc-drop", str(AUC_BUDGET),
        "--max-ne-increase", str(NE_BUDGET), "--out", str(tmp_path), "--prune", "--counts", str(tmp_path / "counts.pt"),
    ])
    assert code == 0
    report = orjson.loads((tmp_path / "planned.plan.json").read_bytes())
    shares = {t["name"]: t["pruned_share"] for t in report["tables"]}
    assert all(shares[name] >= 0.9 for name in NOISE) and all(shares[name] == 0 for name in SIGNAL), shares
    assert report["pruned_rows"] == sum(t["pruned_rows"] for t in report["tables"]) > 0
    _assert_the_moves_are_the_plans(report)
    plan_spec = load_spec(tmp_path / "planned.planned.yaml")
    plan_dtypes = {t.name: t.weight_dtype for t in plan_spec.tables}
    in_planned_dtypes = spec.replace(tables=[t.model_copy(update={"weight_dtype": plan_dtypes[t.name]}) for t in spec.tables])
    unpruned = DLRMFactory(in_planned_dtypes).table_bytes()  # the planned dtypes, every row kept
    saved = sum(unpruned[t["name"]] - t["bytes"] for t in report["tables"] if t["pruned_share"])
    assert report["planned"]["pruning_saved_bytes"] == saved > 0
    kept = torch.load(tmp_path / "planned.pruning.pt", weights_only=True)
    for name in NOISE:  # the most used ids are kept
        assert int(counts[name][kept[name]].min()) >= int(counts[name].sort(descending=True).values[len(kept[name]) - 1])
    _, holdout = split_validation(read_validation(folder / "clicks.jsonl", spec), 0.3, seed=0)
    factory = DLRMFactory(plan_spec)
    served = eager_service(plan_spec, factory.inference_model(factory.quantize(model)))
    checked = verify(served, eager_service(spec, model), holdout,
                     Bounds(max_abs_score_diff=1.0, max_auc_drop=AUC_BUDGET, max_ne_increase=NE_BUDGET))
    assert checked.passed, checked.failures
    assert checked.reference.auc - checked.served.auc == pytest.approx(report["planned"]["auc_drop"], abs=1e-5)
    assert report["planned"]["table_bytes"] < report["best_uniform"]["table_bytes"]


def test_without_counts_pruning_counts_one_half_of_the_plan_data_and_plans_on_the_other(planned, tmp_path):
    folder, _, _ = planned
    code = main([
        "plan", "--spec", str(folder / "spec.yaml"), "--checkpoint", str(folder / "trained.pt"),
        "--data", str(folder / "clicks.jsonl"), "--out", str(tmp_path), "--prune",
    ])
    report = orjson.loads((tmp_path / "planned.plan.json").read_bytes())
    assert code == 0 and "planned on, 88 of 175 requests" in report["data"]["plan"], report["data"]
    assert report["planned"]["within_budget"]
