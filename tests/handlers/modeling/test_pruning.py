"""Pruned tables (``tables[].pruned_to``): the served model looks up the kept ids' rows and a zero
row for every other id; pruned ids are counted per table; the kept-ids file is checked against
the spec; deltas address ids and refuse pruned ones. (An exported program, FBGEMM's remapping
inside the graph, is served through TorchServe in ``tests/integration/test_protocols.py``.)"""

import collections

import numpy as np
import orjson
import pytest
import torch

from archive_tools.build import build_archive
from archive_tools.delta import DeltaSource, make_delta, verify_delta
from archive_tools.model_config import ServingConfig
from archive_tools.verification import Bounds
from handlers.modeling.eager import EagerModel
from handlers.modeling.embedding_modules import table_weights
from handlers.modeling.errors import SpecError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema, parse_spec
from handlers.modeling.spec import WeightDtype
from handlers.loading import load_archive
from handlers.runtime.archive import Archive
from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InputError
from handlers.runtime.pruned_ids import PrunedIdCounter
from handlers.runtime.service import ScoringService
from handlers.runtime.wire.decoder import RequestDecoder
from tests.helpers import PRUNED_TINY, forward, items_request, model_inputs, pruned, with_tables


def _zeroed(model, kept):
    """``model`` with every row but the kept ones zero: what a pruned table serves."""
    weights = table_weights(model)
    with torch.no_grad():
        for name, ids in kept.items():
            dropped = torch.ones(len(weights[name]), dtype=torch.bool)
            dropped[ids] = False
            weights[name][dropped] = 0.0
    return model


def test_a_pruned_table_serves_its_kept_rows_and_a_zero_row_for_other_ids(tiny_spec, tmp_path):
    """fp32 tables, so the only difference from the float model is the pruning: sum and mean
    pooling both count a pruned id as a zero row."""
    spec, kept = pruned(with_tables(tiny_spec, weight_dtype=WeightDtype.FP32), tmp_path)
    factory = DLRMFactory(spec)
    float_model = factory.float_model(seed=0)
    served = factory.inference_model(factory.quantize(float_model))
    inputs = model_inputs(spec, [items_request(spec, 128, seed=5, max_bag=8)])
    scores = forward(served, spec, inputs)
    unpruned = forward(float_model, spec, inputs)
    expected = forward(_zeroed(factory.float_model(seed=0), kept), spec, inputs)
    assert (scores - expected).abs().max() < 1e-5
    assert (scores - unpruned).abs().max() > 1e-3  # the pruning shows
    assert factory.table_bytes()["t_user"] == PRUNED_TINY["t_user"] * 8 * 4


def test_pruned_ids_are_counted_per_table(tiny_spec, tmp_path):
    spec, kept = pruned(tiny_spec, tmp_path)
    schema = input_schema(spec)
    request = items_request(spec, 50, seed=3, max_bag=8)
    counter = PrunedIdCounter(schema, kept)
    counts = counter.count(RequestDecoder(schema).decode(request).inputs)
    by_feature = {f: t.name for t in spec.tables for f in t.features}
    expected = {name: 0 for name in kept}
    for item in request["items"]:
        for feature, ids in item["sparse"].items():
            table = by_feature[feature]
            if table in kept:
                expected[table] += int((~np.isin(ids, kept[table].numpy())).sum())
    assert dict(counts) == expected and all(expected.values())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda raw, kept: raw["tables"][0].update(pruned_to=1000), "tables[0].pruned_to: must be below rows (1000)"),
        (lambda raw, kept: raw.pop("pruning"), "pruning: tables ['t_user', 't_item', 't_category'] are pruned"),
        (lambda raw, kept: kept.update(t_user=kept["t_user"][:-1]), "table t_user: keeps 299 ids, the spec's pruned_to is 300"),
        (lambda raw, kept: kept.update(t_item=kept["t_item"].flip(0)), "table t_item: ids must be distinct, ascending"),
        (lambda raw, kept: kept.update(t_hour=torch.tensor([1])), "tables ['t_hour'] are not pruned in the spec"),
        (lambda raw, kept: raw.update(pruning="/nowhere/pruning.pt"), "pruning: /nowhere/pruning.pt: no such file"),
    ],
)
def test_a_pruning_that_does_not_fit_the_spec_is_refused_naming_it(tiny_spec, tmp_path, change, message):
    spec, kept = pruned(tiny_spec, tmp_path)
    raw = spec.to_dict()
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        change(raw, kept)
        torch.save(kept, tmp_path / "pruning.pt")
        DLRMFactory(parse_spec(raw))


def test_deltas_address_ids_and_refuse_pruned_ones(tiny_spec, tmp_path):
    spec, kept = pruned(tiny_spec, tmp_path)
    spec.to_yaml(tmp_path / "tiny.yaml")
    factory = DLRMFactory(spec)
    model = factory.float_model(seed=0)
    torch.save(model.state_dict(), tmp_path / "base.pt")
    archive = build_archive(
        tmp_path / "tiny.yaml", checkpoint=tmp_path / "base.pt", seed=0, name="tiny", version="1.0",
        model_store=tmp_path / "store", serving=ServingConfig(), bounds=Bounds(max_auc_drop=1.0, max_ne_increase=1.0),
    )
    newer = {k: v.clone() for k, v in model.state_dict().items()}
    key = next(k for k in newer if k.endswith("t_user.weight"))
    dropped = next(i for i in range(1000) if i not in set(kept["t_user"].tolist()))
    newer[key][[int(kept["t_user"][5]), dropped]] += 0.5
    torch.save(newer, tmp_path / "newer.pt")
    summary = make_delta(archive, DeltaSource(checkpoint=tmp_path / "newer.pt"), tmp_path / "1.delta", sequence=1)
    assert summary.rows_by_table == {"t_user": 1}  # the kept id's row; the pruned id has none
    assert verify_delta(archive, summary.path, tmp_path / "newer.pt") == []
    torch.save({"t_user": {"ids": torch.tensor([int(kept["t_user"][0]), dropped]), "rows": torch.zeros(2, 8)}},
               tmp_path / "rows.pt")
    with pytest.raises(InputError, match=f"t_user.ids: id {dropped} was pruned from table t_user"):
        make_delta(archive, DeltaSource(rows=tmp_path / "rows.pt"), tmp_path / "2.delta", sequence=2)


def test_a_distributed_layouts_shards_take_their_own_pruned_tables_from_the_models_file(tiny_spec, tmp_path):
    """Each shard's spec names the model's kept-ids file and reads its own tables from it; a shard
    with no pruned table names none. (The layout, built with --artifact distributed, scores
    exactly as the single-host pruned model: measured, AUC and the largest difference equal.)"""
    spec, kept = pruned(tiny_spec, tmp_path)
    placed = spec.replace(tables=[t.model_copy(update={"shard": "a" if t.name == "t_item" else "b"}) for t in spec.tables])
    item_shard = DLRMFactory(placed.shard_spec("a"))
    assert set(item_shard.kept) == {"t_item"} and torch.equal(item_shard.kept["t_item"], kept["t_item"])
    unpruned = placed.replace(tables=[t.model_copy(update={"pruned_to": None} if t.name != "t_item" else {}) for t in placed.tables])
    assert unpruned.shard_spec("b").pruning is None


def test_a_batch_of_several_requests_counts_each_requests_pruned_ids(tiny_spec, tmp_path):
    """The service counts per decoded part, which may hold several requests decoded together."""
    spec, kept = pruned(tiny_spec, tmp_path)
    schema = input_schema(spec)
    factory = DLRMFactory(spec)
    service = ScoringService(schema, EagerModel(factory.inference_model(factory.random_weights(0)), schema.tags),
                             pruned_ids=PrunedIdCounter(schema, kept))
    bodies = [items_request(spec, n, seed=n, max_bag=8) for n in (3, 5, 2)]
    counter = PrunedIdCounter(schema, kept)
    expected = sum((counter.count(RequestDecoder(schema).decode(b).inputs) for b in bodies), collections.Counter())
    handled = service.handle([orjson.dumps(b) for b in bodies])
    assert all(r.status == 200 for r in handled.responses)
    assert handled.stats.pruned_ids == dict(expected) and sum(expected.values()) > 0


@pytest.mark.parametrize("artifact", [Artifact.EAGER, Artifact.EXPORTED])
def test_a_pruned_archive_without_its_kept_ids_file_is_refused_at_load_naming_the_file(tiny_spec, tmp_path, artifact):
    """A graph artifact reads no spec: the kept ids are read for the pruned-id counter alone, and
    their absence is named before the model loads, in every artifact kind."""
    spec, _ = pruned(tiny_spec, tmp_path)
    spec.to_yaml(tmp_path / "tiny.yaml")
    folder = build_archive(
        tmp_path / "tiny.yaml", checkpoint=None, seed=0, name="tiny", version="1.0", model_store=tmp_path / "store",
        serving=ServingConfig(), bounds=Bounds(max_auc_drop=1.0, max_ne_increase=1.0), archive_format="no-archive",
        artifact=artifact,
    )
    assert load_archive(Archive(folder)).pruned_ids is not None
    (folder / "pruning.pt").unlink()
    with pytest.raises(FileNotFoundError, match=f"{folder}: holds no pruning.pt, the kept ids of its pruned tables "
                                                r"\(t_category, t_item, t_user\)"):
        load_archive(Archive(folder))
