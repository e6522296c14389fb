"""The commands: inconsistent split options refused before building anything, an unzipped
archive replaced whole, failures as one line with a code per kind."""

import gc
import importlib
import json
import subprocess
import sys

import pytest
import torch
import yaml

from archive_tools import cli_args
from archive_tools.cli import EXIT_CODES, main
from handlers.modeling.registry import load_spec
from handlers.modeling.spec import Pooling, ShardingSpec, ShardingType, WeightDtype
from handlers.runtime.artifacts import Artifact
from handlers.runtime.options import HandlerOptions
from handlers.runtime.split import SplitPlan
from tests.helpers import with_tables
from tests.conftest import TINY_SPEC


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sparse", "eager"], "--sparse: only with --artifact split"),
        (["--dense", "aoti", "--dense-device", "cpu"], "--dense/--dense-device: only with --artifact split"),
        (["--artifact", "split", "--dense-device", "cuda"], "dense_device: cuda needs dense: exported"),
    ],
)
def test_split_options_are_checked_on_the_command_line(extra, message, capsys, tmp_path):
    assert build(["--spec", str(TINY_SPEC), "--model-store", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert f"torchrec-serve build: error: {message}" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir()), "nothing is written"


SHARDED_SPEC = TINY_SPEC.parent.parent.parent / "examples" / "distributed" / "tiny_sharded.yaml"


@pytest.mark.parametrize(
    "spec, extra, message",
    [
        (SHARDED_SPEC, ["--sparse", "eager"], "--sparse/--dense-device: a distributed layout's shards serve eager lookups"),
        (TINY_SPEC, [], "tables[].shard: no table names its shard"),
    ],
)
def test_a_distributed_build_is_checked_before_building(spec, extra, message, capsys, tmp_path):
    assert build(["--spec", str(spec), "--artifact", "distributed", "--model-store", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not any(tmp_path.iterdir()), "nothing is written"


def test_an_artifact_argparse_does_not_know_is_a_usage_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        build(["--spec", str(TINY_SPEC), "--artifact", "split", "--dense", "eager"])
    assert exit_.value.code == 2
    assert "invalid choice: 'eager'" in capsys.readouterr().err


def test_a_shipped_spec_is_named_by_its_name(tmp_path):
    assert build(["--spec", "tiny", "--model-store", str(tmp_path)]) == 0
    assert (tmp_path / "tiny.mar").is_file()


def build(arguments: list[str]) -> int:
    return main(["build", *arguments])


def test_an_unzipped_archive_is_replaced_whole(tmp_path):
    """Rebuilt as another artifact, the folder keeps no file of the earlier build."""
    common = ["--spec", str(TINY_SPEC), "--model-store", str(tmp_path), "--archive-format", "no-archive"]
    assert build(common) == 0
    assert (tmp_path / "tiny" / "weights.pt").exists()
    assert build([*common, "--artifact", "exported"]) == 0
    files = {p.name for p in (tmp_path / "tiny").iterdir()}
    assert "model.pt2" in files and "weights.pt" not in files


def test_a_folder_that_is_not_an_archive_is_not_replaced(tmp_path, capsys):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "notes.txt").write_text("mine")
    common = ["--spec", str(TINY_SPEC), "--model-store", str(tmp_path), "--archive-format", "no-archive"]
    assert build(common) == 7
    assert "is not an archive folder; not replacing it" in capsys.readouterr().err
    assert (tmp_path / "tiny" / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path of a GPU-bound build")
def test_a_dense_part_for_a_gpu_is_built_and_verified_on_a_cpu_machine(tmp_path):
    assert build([
        "--spec", str(TINY_SPEC), "--model-store", str(tmp_path), "--archive-format", "no-archive",
        "--artifact", "split", "--dense", "exported", "--dense-device", "cuda",
    ]) == 0
    config = yaml.safe_load((tmp_path / "tiny" / "model-config.yaml").read_text())
    assert config["handler"] == HandlerOptions(
        Artifact.SPLIT, SplitPlan(Artifact.EXPORTED, Artifact.EXPORTED, "cuda"),
        intra_op_threads=2, parallel_from_items=400, metrics_flush_s=1.0,
    ).to_mapping()
    assert json.loads((tmp_path / "tiny.verification.json").read_text())["passed"]


def test_row_wise_sharded_tables_are_refused_for_a_graph_before_building(tmp_path, capsys):
    spec = with_tables(load_spec(TINY_SPEC), weight_dtype=WeightDtype.INT8)
    spec = spec.replace(
        tables=[
            t.model_copy(update={"sharding": ShardingType.ROW_WISE, "pooling": Pooling.SUM})
            if t.name == "t_user" else t
            for t in spec.tables
        ],
        sharding=ShardingSpec(device="cpu", world_size=2),
    )
    spec.to_yaml(tmp_path / "sharded.yaml")
    common = ["--spec", str(tmp_path / "sharded.yaml"), "--model-store", str(tmp_path / "store")]
    assert build([*common, "--artifact", "exported"]) == 2
    assert "tables ['t_user']: row-wise sharded tables cannot be captured" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()
    assert build(common) == 0  # served eager, the same spec builds


def test_a_bad_spec_is_one_line_and_exit_code_3(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("name: bad\ndense_features: 0\nbottom_mlp: [8]\ntop_mlp: [1]\n")
    assert build(["--spec", str(tmp_path / "bad.yaml"), "--model-store", str(tmp_path)]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("torchrec-serve build: error: dense_features: must be greater than 0")
    with pytest.raises(Exception, match="dense_features"):  # --debug: the traceback, not a line
        main(["build", "--debug", "--spec", str(tmp_path / "bad.yaml")])


def test_verify_checks_an_archive_against_the_weights_it_came_from(tmp_path, capsys):
    assert build(["--spec", "tiny", "--seed", "3", "--model-store", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "tiny.mar"), "--seed", "3"]) == 0
    assert "passed" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "tiny.mar"), "--seed", "4"]) == 8  # other weights
    out, err = capsys.readouterr()
    assert "FAILED: AUC drop" in out  # untrained weights score near 0.5, but rank differently
    assert err.strip().startswith("torchrec-serve verify: error:") and "Traceback" not in err


def test_the_build_prints_every_tables_dtype_and_marks_defaults(tmp_path, capsys):
    assert build(["--spec", "tiny", "--model-store", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "spec tiny (dlrm): 4 dense features, 5 sparse features in 4 tables" in err
    user = next(line for line in err.splitlines() if line.strip().startswith("t_user"))
    assert user.split()[:6] == ["t_user", "1,000", "8", "int8", "sum", "(default)"]
    assert "dense precision: fp32 (default)" in err
    # no terminal: a line per stage, not a bar's redraws run into the printed lines
    assert "archive: verify\n" in err and "stage/s" not in err


def test_the_build_names_each_raw_id_tables_remap_and_its_slot_maps_bytes(tiny_spec, tmp_path, capsys):
    tables = [
        {"name": "t_user", "rows": 100, "dim": 8, "features": ["user_id"], "ids": "raw", "remap": {"kind": "mch"}},
        {"name": "t_item", "rows": 64, "dim": 8, "features": ["item_id"], "ids": "raw",
         "remap": {"kind": "zch", "max_probe": 16, "buckets": 2, "unseen": "zero"}},
    ]
    tiny_spec.replace(name="raw", tables=tables).to_yaml(tmp_path / "raw.yaml")
    assert build(["--spec", str(tmp_path / "raw.yaml"), "--init", "quantized", "--model-store", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert ("raw ids: t_user mch (eviction lfu, unseen default_row), t_item zch (max_probe 16, buckets 2, "
            "unseen zero); slot maps 2.1 KiB beside the tables") in err  # 100 x 16 + 64 x 8 bytes


def test_the_build_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: eager)", "(default: 32)", "(default: 5)", "(default: 0.02)", "(default: 0.001)"):
        assert default in out, default
    # an option without a default, or whose help states its own, gets no second one
    assert "(default: None)" not in out and "(default: the spec's name)" in out
    assert "(default: the spec's name) (default:" not in out


def test_a_bad_validation_file_is_exit_code_5_naming_the_line(tmp_path, capsys):
    (tmp_path / "eval.jsonl").write_text('{"dense": [0, 0, 0, 0], "label": 1}\n{"dense": [0], "label": 0}\n')
    code = build(["--spec", "tiny", "--model-store", str(tmp_path), "--validation", str(tmp_path / "eval.jsonl")])
    assert code == 5
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"torchrec-serve build: error: {tmp_path / 'eval.jsonl'}:2: items[0].dense: must hold 4 numbers, got 1"
    )


def test_a_checkpoint_that_does_not_match_is_exit_code_4_with_the_fix(tmp_path, capsys):
    torch.save({"dense_arch.weight": torch.zeros(2)}, tmp_path / "other.pt")
    assert build(["--spec", "tiny", "--checkpoint", str(tmp_path / "other.pt"), "--model-store", str(tmp_path)]) == 4
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "checkpoint does not match the spec" in last and "checkpoint_mapping.prefixes" in last


def test_the_build_compares_dense_precisions_and_suggests_one(tmp_path, capsys):
    assert build(["--spec", "tiny", "--model-store", str(tmp_path), "--compare-dense-precisions"]) == 0
    err = capsys.readouterr().err
    table = [line.split() for line in err.splitlines() if line.strip().split(" ")[0] in
             ("fp32", "bf16", "fp16", "int8_weight_only", "int8_dynamic")]
    assert [row[0] for row in table] == ["fp32", "bf16", "fp16", "int8_weight_only", "int8_dynamic"]
    assert all(row[-1] in ("passes", "fails") for row in table)
    assert "fastest that passes for one item:" in err and "fastest that passes for large batches:" in err


def test_an_unexpected_error_is_an_internal_error_not_a_usage_error(tmp_path, capsys, monkeypatch):
    """A ValueError from deep inside torch or numpy is the project's bug: exit 1, one line that
    says so with the --debug hint (it used to read as a usage error, exit 2)."""
    def broken(*args, **kwargs):
        raise ValueError("operands could not be broadcast together\nwith shapes (3,) (4,)")

    monkeypatch.setattr("archive_tools.build.build_archive", broken)  # the command imports it as it runs
    assert build(["--spec", "tiny", "--model-store", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "torchrec-serve build: internal error: ValueError: operands could not be broadcast together "
        "(a bug in torchrec-serve; --debug shows the traceback)"
    ]
    with pytest.raises(ValueError, match="operands"):
        main(["build", "--debug", "--spec", "tiny", "--model-store", str(tmp_path)])


def test_every_exit_code_names_an_exception_class():
    """The codes name their classes by module (a command imports what it runs): each name must
    still be a class of exception there, or its failures would read as internal errors."""
    for where in EXIT_CODES:
        module, name = where.split(":")
        kind = getattr(importlib.import_module(module), name, None)
        assert isinstance(kind, type) and issubclass(kind, Exception), where


def test_serve_and_bench_start_without_torch():
    """The command line is imported again by each process of an asgi server (uvicorn spawns them,
    and each imports what its app needs), and ``bench`` runs the benchmarks in a process of their
    own: parsing either command imports no torch (seconds of CPU per process)."""
    program = (
        "import sys; from archive_tools import cli; "
        "[cli._parser(c).parse_args([c, 'x']) for c in ('serve', 'bench')]; print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr


def test_the_projects_own_errors_keep_their_exit_codes(tmp_path, capsys):
    assert build(["--spec", "tiny", "--init", "quantized", "--checkpoint", "x.pt"]) == 2
    assert capsys.readouterr().err.strip() == (
        "torchrec-serve build: error: --init quantized makes random tables; it does not read --checkpoint"
    )


def test_files_that_are_not_what_they_should_be_are_the_users_errors_not_internal_ones(tmp_path, capsys):
    (tmp_path / "notes.pt").write_text("not a torch file")
    assert build(["--spec", "tiny", "--checkpoint", str(tmp_path / "notes.pt"), "--model-store", str(tmp_path)]) == 4
    assert f"{tmp_path / 'notes.pt'}: not a checkpoint torch can load" in capsys.readouterr().err
    assert build(["--spec", "tiny", "--model-store", str(tmp_path)]) == 0
    capsys.readouterr()
    torch.save({"t_user": [1, 2]}, tmp_path / "rows.pt")
    delta = ["delta", str(tmp_path / "tiny.mar"), "--sequence", "1", "--out", str(tmp_path / "d.delta")]
    assert main([*delta, "--rows", str(tmp_path / "rows.pt")]) == 2
    assert "must map each table's name to {'ids'" in capsys.readouterr().err
    assert main([*delta, "--rows", str(tmp_path / "notes.pt")]) == 2
    assert f"{tmp_path / 'notes.pt'}: not a rows file torch can load" in capsys.readouterr().err


def test_a_layout_file_that_is_not_yaml_is_named(tmp_path):
    from archive_tools.launcher import LayoutFile
    from handlers.runtime.errors import InputError

    (tmp_path / "layout.yaml").write_text("shards: {a: [unclosed\n")
    with pytest.raises(InputError, match=r"layout.yaml: not valid YAML"):
        LayoutFile.read(tmp_path / "layout.yaml")


def test_the_collector_paused_for_parsing_is_on_again_whether_the_command_line_parses_or_not(capsys, monkeypatch):
    collecting = []  # while the build's options are added (their defaults import the pipeline)
    add_options = cli_args.build_args
    monkeypatch.setattr(cli_args, "build_args", lambda parser: (collecting.append(gc.isenabled()), add_options(parser)))
    with pytest.raises(SystemExit):
        main(["build", "--spec", "tiny", "--no-such-option"])
    assert collecting == [False] and gc.isenabled()
    assert "--no-such-option" in capsys.readouterr().err
