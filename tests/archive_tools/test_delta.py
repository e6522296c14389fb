"""``torchrec-serve delta``: changed rows quantized exactly as a fresh build quantizes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.cli import main
from archive_tools.delta import DeltaSource, make_delta, served_rows, table_rows, verify_delta
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.weights import load_weights_file
from handlers.runtime.freshness.delta_file import read_delta
from handlers.runtime.freshness.layout import TablesLayout
from tests.conftest import TINY_SPEC


def test_rows_quantized_alone_equal_the_whole_table_quantized_by_torchrec(tiny_spec, tiny_float_model, tmp_path):
    """int8, int4, fp16 and fp32 tables (tiny has one of each), padding included."""
    factory = DLRMFactory(tiny_spec)
    factory.save_weights(factory.quantize(tiny_float_model), tmp_path / "weights.pt")
    layout = factory.tables_layout(tmp_path / "weights.pt")
    buffers, *_ = load_weights_file(tmp_path / "weights.pt", 1 + max(t.buffer for t in layout.tables))
    floats = {n.split(".")[-2]: p for n, p in tiny_float_model.named_parameters() if ".embedding_bags." in n}
    assert {t.dtype for t in layout.tables} == {"int8", "int4", "fp16", "fp32"}
    for table in layout.tables:
        some = torch.tensor([0, 3, table.rows - 1])
        np.testing.assert_array_equal(served_rows(floats[table.name][some], table), table_rows(buffers[table.buffer], table)[some])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("delta")
    from handlers.modeling.registry import load_spec

    model = DLRMFactory(load_spec(TINY_SPEC)).float_model(seed=0)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    newer = {k: v.clone() for k, v in base.items()}
    for key in newer:
        if ".embedding_bags." in key:
            newer[key][[1, 5, 7]] += 0.01
    torch.save(base, folder / "base.pt")
    torch.save(newer, folder / "newer.pt")
    archive = build_archive(TINY_SPEC, checkpoint=folder / "base.pt", seed=0, name="tiny", version="1.0",
                            model_store=folder / "store", serving=ServingConfig())
    return folder, archive


def test_a_delta_from_a_checkpoint_holds_only_changed_rows_and_verifies(checkpoints):
    folder, archive = checkpoints
    summary = make_delta(archive, DeltaSource(checkpoint=folder / "newer.pt"), folder / "1.delta", sequence=1)
    assert summary.rows_by_table == {"t_user": 3, "t_item": 3, "t_category": 3, "t_hour": 3}
    delta = read_delta(summary.path, TablesLayout.load(_unpacked(archive, folder)))
    assert all(delta.records(s)["id"].tolist() == [1, 5, 7] for s in delta.header.tables)
    assert verify_delta(archive, summary.path, folder / "newer.pt") == []
    assert verify_delta(archive, summary.path, folder / "base.pt") != []  # the check can fail


def test_a_delta_from_given_rows(checkpoints, tiny_spec):
    folder, archive = checkpoints
    floats = torch.rand(3, 8)
    torch.save({"t_user": {"ids": torch.tensor([4, 2, 9]), "rows": floats}}, folder / "rows.pt")  # any order
    summary = make_delta(archive, DeltaSource(rows=folder / "rows.pt"), folder / "2.delta", sequence=2)
    assert summary.rows_by_table == {"t_user": 3}
    layout = TablesLayout.load(_unpacked(archive, folder))
    delta = read_delta(summary.path, layout)
    records = delta.records(delta.header.tables[0])
    assert records["id"].tolist() == [2, 4, 9]  # in order, each with its own row
    assert np.array_equal(records["row"], served_rows(floats[[1, 0, 2]], layout.table("t_user")))
    torch.save({"t_user": {"ids": torch.tensor([1000]), "rows": torch.rand(1, 8)}}, folder / "bad.pt")
    with pytest.raises(ValueError, match="t_user.ids must lie in 0..999"):
        make_delta(archive, DeltaSource(rows=folder / "bad.pt"), folder / "3.delta", sequence=3)
    torch.save({"t_user": {"ids": torch.tensor([5, 3, 5]), "rows": torch.rand(3, 8)}}, folder / "twice.pt")
    with pytest.raises(ValueError, match="t_user.ids gives id 5 more than once"):
        make_delta(archive, DeltaSource(rows=folder / "twice.pt"), folder / "3.delta", sequence=3)


def test_the_delta_command_writes_and_verifies(checkpoints, capsys):
    folder, archive = checkpoints
    code = main(["delta", str(archive), "--checkpoint", str(folder / "newer.pt"), "--sequence", "1", "--verify"])
    assert code == 0
    err = capsys.readouterr().err
    assert "tiny-00000001.delta" in err and "byte for byte" in err
    assert (archive.parent / "deltas" / "tiny-00000001.delta").exists()


def _unpacked(archive, folder):
    import zipfile

    target = folder / "unpacked"
    with zipfile.ZipFile(archive) as z:
        z.extractall(target)
    return target
