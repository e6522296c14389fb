"""The archive tool's command line: inconsistent split options refused before building anything,
an unzipped archive replaced whole."""

import dataclasses
import json

import pytest
import torch
import yaml

from archive_tools.build import main
from handlers.export import Artifact
from handlers.options import HandlerOptions
from handlers.spec import ModelSpec, Pooling, ShardingSpec, ShardingType, WeightDtype
from handlers.split import SplitPlan
from tests.helpers import with_tables
from tests.conftest import TINY_SPEC


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sparse", "eager"], "--sparse: only with --artifact split"),
        (["--dense", "aoti", "--dense-device", "cpu"], "--dense/--dense-device: only with --artifact split"),
        (["--artifact", "split", "--dense-device", "cuda"], "dense_device: cuda needs dense: exported"),
        (["--artifact", "split", "--dense", "eager"], "invalid choice: 'eager'"),
    ],
)
def test_split_options_are_checked_on_the_command_line(extra, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["--spec", str(TINY_SPEC), "--model-store", str(tmp_path), *extra])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written"


def test_an_unzipped_archive_is_replaced_whole(tmp_path):
    """Rebuilt as another artifact, the folder keeps no file of the earlier build."""
    common = ["--spec", str(TINY_SPEC), "--model-store", str(tmp_path), "--archive-format", "no-archive"]
    assert main(common) == 0
    assert (tmp_path / "tiny" / "weights.pt").exists()
    assert main([*common, "--artifact", "exported"]) == 0
    files = {p.name for p in (tmp_path / "tiny").iterdir()}
    assert "model.pt2" in files and "weights.pt" not in files


def test_a_folder_that_is_not_an_archive_is_not_replaced(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "notes.txt").write_text("mine")
    common = ["--spec", str(TINY_SPEC), "--model-store", str(tmp_path), "--archive-format", "no-archive"]
    with pytest.raises(FileExistsError, match="not an archive folder"):
        main(common)
    assert (tmp_path / "tiny" / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path of a GPU-bound build")
def test_a_dense_part_for_a_gpu_is_built_and_verified_on_a_cpu_machine(tmp_path):
    assert main([
        "--spec", str(TINY_SPEC), "--model-store", str(tmp_path), "--archive-format", "no-archive",
        "--artifact", "split", "--dense", "exported", "--dense-device", "cuda",
    ]) == 0
    config = yaml.safe_load((tmp_path / "tiny" / "model-config.yaml").read_text())
    assert config["handler"] == HandlerOptions(
        Artifact.SPLIT, SplitPlan(Artifact.EXPORTED, Artifact.EXPORTED, "cuda")
    ).to_mapping()
    assert json.loads((tmp_path / "tiny.verification.json").read_text())["passed"]


def test_row_wise_sharded_tables_are_refused_for_a_graph_before_building(tmp_path):
    spec = with_tables(ModelSpec.from_yaml(TINY_SPEC), weight_dtype=WeightDtype.INT8)
    spec = dataclasses.replace(
        spec,
        tables=tuple(
            dataclasses.replace(t, sharding=ShardingType.ROW_WISE, pooling=Pooling.SUM)
            if t.name == "t_user" else t
            for t in spec.tables
        ),
        sharding=ShardingSpec("cpu", 2),
    )
    spec.to_yaml(tmp_path / "sharded.yaml")
    common = ["--spec", str(tmp_path / "sharded.yaml"), "--model-store", str(tmp_path / "store")]
    with pytest.raises(ValueError, match=r"tables \['t_user'\]: row-wise sharded tables cannot be captured"):
        main([*common, "--artifact", "exported"])
    assert not (tmp_path / "store").exists()
    assert main(common) == 0  # served eager, the same spec builds
