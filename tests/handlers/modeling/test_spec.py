"""The spec: YAML parsed once into the architecture's typed spec; every error names its key path;
the shipped JSON Schema and reference are what the models generate."""

import copy
import json

import pytest
import yaml

from archive_tools.spec_docs import spec_reference
from handlers.modeling.errors import SpecError
from handlers.modeling.registry import load_spec, parse_spec, spec_json_schema
from handlers.modeling.spec import OutOfRangePolicy, Pooling, WeightDtype
from tests.conftest import CRITEO_SPEC, MODELS, RANKER_SPEC, TINY_SPEC


def test_tiny_spec_loads_typed(tiny_spec):
    assert tiny_spec.feature_names == ("user_id", "item_id", "last_item_id", "category", "hour")
    assert tiny_spec.feature_rows == (1000, 500, 500, 50, 24)
    assert tiny_spec.tables[1].weight_dtype == WeightDtype.INT4
    assert tiny_spec.tables[2].pooling == Pooling.MEAN
    assert not tiny_spec.is_sharded


def test_criteo_spec_has_criteo_shape():
    spec = load_spec(CRITEO_SPEC)
    assert spec.dense_features == 13
    assert spec.feature_names == tuple(f"cat_{i}" for i in range(26))
    assert spec.bottom_mlp == (512, 256, 64) and spec.top_mlp == (512, 512, 256, 1)
    assert spec.out_of_range == OutOfRangePolicy.HASH


def test_ranker_spec_loads_typed(ranker_spec):
    assert ranker_spec.architecture == "context_ranker"
    assert ranker_spec.context_features == 8 and ranker_spec.context_mlp == (16, 8)
    assert ranker_spec.weighted_ids
    # No DLRM dot products here: tables may have dims of their own.
    assert [t.dim for t in ranker_spec.tables] == [16, 8, 4]


@pytest.mark.parametrize("spec_path", sorted(MODELS.glob("*.yaml")), ids=lambda p: p.stem)
def test_round_trips_through_yaml(spec_path, tmp_path):
    spec = load_spec(spec_path)
    spec.to_yaml(tmp_path / "spec.yaml")
    assert load_spec(tmp_path / "spec.yaml") == spec


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("context_features", "delete", "context_features: required key is missing"),
        ("context_mlp", [8, 0], "context_mlp[1]: must be greater than 0, got 0"),
        ("weighted_ids", "yes", "weighted_ids: must be a valid boolean, got 'yes'"),
        ("architecture", "two_tower", "architecture: 'two_tower' is neither a registered architecture"),
        ("tables", [{"name": "t", "rows": 9, "dim": 4, "features": ["f"], "pooling": "mean"}],
         "tables[0].pooling: weighted_ids needs sum pooling"),
    ],
)
def test_bad_ranker_spec_names_the_key(key, value, message):
    raw = yaml.safe_load(RANKER_SPEC.read_text())
    if value == "delete":
        del raw[key]
    else:
        raw[key] = value
    with pytest.raises(SpecError) as error:
        parse_spec(raw)
    assert message in str(error.value)


def test_dlrm_spec_refuses_context_keys():
    raw = yaml.safe_load(TINY_SPEC.read_text())
    raw["context_features"] = 8
    with pytest.raises(SpecError, match="^context_features: unknown key$"):
        parse_spec(raw)


_DELETE = object()
_RAW_USER = {"name": "t_user", "rows": 1000, "dim": 8, "features": ["user_id"], "ids": "raw", "remap": {"kind": "mch"}}


def _edit(path, value):
    raw = yaml.safe_load(TINY_SPEC.read_text())
    target = raw
    *parents, last = path
    for key in parents:
        target = target[key]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return raw


@pytest.mark.parametrize(
    "path, value, message",
    [
        (["name"], _DELETE, "name: required key is missing"),
        (["dense_features"], 0, "dense_features: must be greater than 0, got 0"),
        (["dense_features"], True, "dense_features: must be a valid integer, got True"),
        (["bottom_mlp"], [16, "8"], "bottom_mlp[1]: must be a valid integer, got '8'"),
        (["top_mlp"], [16, 2], "top_mlp: last layer must be 1"),
        (["tables"], [], "tables: must hold at least 1, got []"),
        (["tables", 0, "dim"], 4, "tables[0].dim: must equal bottom_mlp[-1] (8)"),
        (["tables", 1, "dim"], 7, "tables[1].dim: int4 tables pack 2 values per byte: dim must be a multiple of 2, got 7"),
        (["tables", 0, "weight_dtype"], "int3", "tables[0].weight_dtype: must be 'fp32', 'fp16', 'int8', 'int4' or 'int2', got 'int3'"),
        (["tables", 0, "pooling"], "max", "tables[0].pooling: must be 'sum', 'mean' or 'none', got 'max'"),
        (["tables", 0, "rows"], -5, "tables[0].rows: must be greater than 0, got -5"),
        (["tables", 0, "max_sequence_length"], 50, "tables[0].max_sequence_length: only for sequence tables"),
        (["tables", 0, "name"], "items", "tables[0].name: 'items' is taken by TorchRec's module dict of tables"),
        (["tables", 0], {"name": "t_user", "rows": 1000, "dim": 8, "features": ["user_id"], "pooling": "none",
                         "sharding": "table_wise"},
         "tables[0].pooling: sequence tables (pooling none) are served whole on one host"),
        (["tables", 0, "colour"], "red", "tables[0].colour: unknown key"),
        (["tables", 1, "name"], "t_user", "tables[1].name: duplicate table name"),
        (["tables", 1, "features"], ["user_id"], "tables[1].features: feature 'user_id' is used by two tables"),
        (["tables", 0, "sharding"], "column_wise", "tables[0].sharding: column_wise sharding"),
        (["tables", 2, "sharding"], "row_wise", "tables[2].sharding: row_wise sharding gives wrong results with mean"),
        (["sharding"], {"device": "tpu"}, "sharding.device: must be 'cpu' or 'cuda', got 'tpu'"),
        (["sharding"], {"world_size": 2}, "tables[2].weight_dtype: a sharded model needs int8, int4 or int2"),
        (["out_of_range"], "clip", "out_of_range: must be 'reject' or 'hash', got 'clip'"),
        (["limits", "max_items_per_request"], 5000, "limits.max_items_per_request: must not exceed"),
        (["limits", "max_ids"], 3, "limits.max_ids: unknown key"),
        (["checkpoint_mapping"], {"prefixes": {"module.": 3}}, "checkpoint_mapping.prefixes.module.: must be a valid string, got 3"),
        (["extra"], 1, "extra: unknown key"),
        (["dense_precision"], {"over_arch": "int2"}, "dense_precision.over_arch: must be 'fp32', 'bf16'"),
        (["dense_precision"], {"context_arch": "bf16"}, "dense_precision.context_arch: not a dense submodule of dlrm"),
        (["tables", 0, "ids"], "raw", "tables[0].remap: a table with ids raw names its remap, and only such a table"),
        (["tables", 0, "remap"], {"kind": "mch"}, "tables[0].remap: a table with ids raw names its remap"),
        (["tables", 0], {**_RAW_USER, "remap": {"kind": "zch", "unseen": "default_row"}},
         "tables[0].remap.unseen: zch tables serve probe_slot or zero, not default_row"),
        (["tables", 0], {**_RAW_USER, "remap": {"kind": "mch", "unseen": "probe_slot"}},
         "tables[0].remap.unseen: mch tables serve default_row or zero, not probe_slot"),
        (["tables", 0], {**_RAW_USER, "remap": {"kind": "zch", "eviction": "lru"}},
         "tables[0].remap.eviction: a setting of mch tables, not zch"),
        (["tables", 0], {**_RAW_USER, "remap": {"kind": "mch", "max_probe": 4}},
         "tables[0].remap.max_probe: a setting of zch tables, not mch"),
        (["tables", 0], {**_RAW_USER, "remap": {"kind": "zch", "buckets": 7}},
         "tables[0].remap.buckets: rows (1000) must split evenly into 7 buckets"),
        (["tables", 0], {**_RAW_USER, "remap": {"kind": "mch", "unseen": "none"}},
         "tables[0].remap.unseen: must be 'default_row', 'zero' or 'probe_slot', got 'none'"),
        (["tables", 0], {**_RAW_USER, "remap": {"kind": "mch", "eviction": "fifo"}},
         "tables[0].remap.eviction: must be 'lfu', 'lru' or 'distance_lfu', got 'fifo'"),
        (["tables", 0], {**_RAW_USER, "remap": {"kind": "mch", "eviction_interval": 0}},
         "tables[0].remap.eviction_interval: must be greater than 0"),
        (["tables", 0], {**_RAW_USER, "sharding": "table_wise"}, "tables[0].sharding: ids raw: raw-id tables are served unsharded"),
        (["tables", 0], {**_RAW_USER, "shard": "a"}, "tables[0].shard: ids raw: raw-id tables are not placed on shards yet"),
        (["tables", 0], {**_RAW_USER, "pooling": "none"}, "tables[0].pooling: ids raw: sequence tables with raw ids"),
        (["tables", 0, "ids_per_item"], {"min": 2, "max": 1}, "tables[0].ids_per_item.max: must be at least min (2), got 1"),
        (["tables", 0, "ids_per_item"], {"min": -1}, "tables[0].ids_per_item.min: must be greater than or equal to 0"),
        (["tables", 0, "ids_per_item"], {"max": 65}, "tables[0].ids_per_item: at most the bag cap (64"),
        (["tables", 1, "ids_per_feature"], {"last_item_id": {"min": 70}}, "tables[1].ids_per_feature.last_item_id: at most the bag cap (64"),
        (["tables", 1, "ids_per_feature"], {"user_id": {"min": 1}}, "tables[1].ids_per_feature.user_id: not a feature of this table"),
    ],
)
def test_bad_spec_names_the_key(path, value, message):
    with pytest.raises(SpecError) as error:
        parse_spec(_edit(path, value))
    assert message in str(error.value)


def test_every_bad_key_is_reported_at_once():
    raw = _edit(["dense_features"], 0)
    raw["extra"] = 1
    with pytest.raises(SpecError) as error:
        parse_spec(raw)
    assert "dense_features: must be greater than 0" in str(error.value)
    assert "extra: unknown key" in str(error.value)


def test_not_a_mapping():
    with pytest.raises(SpecError, match="spec: must be a mapping"):
        parse_spec(["name"])


def test_invalid_yaml(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(tmp_path / "bad.yaml")


def test_id_counts_per_table_and_per_feature():
    raw = _edit(["tables", 1, "ids_per_item"], {"min": 1, "max": 1})
    raw["tables"][1]["ids_per_feature"] = {"last_item_id": {"min": 0, "max": 5}}
    table = parse_spec(raw).tables[1]
    assert (table.ids_of("item_id").min, table.ids_of("item_id").max) == (1, 1)
    assert (table.ids_of("last_item_id").min, table.ids_of("last_item_id").max) == (0, 5)


def test_checkpoint_mapping_applies_prefixes_in_order():
    raw = _edit(["checkpoint_mapping"], {"prefixes": {"module.": "", "sparse.old.": "sparse.new."}})
    mapping = parse_spec(copy.deepcopy(raw)).checkpoint_mapping
    assert mapping.apply("module.sparse.old.weight") == "sparse.new.weight"
    assert mapping.apply("dense.weight") == "dense.weight"


def test_shipped_json_schema_and_reference_are_current():
    """config/models/spec.schema.json and SPEC.md are generated; regenerate them with
    ``torchrec-serve spec-docs`` after changing a spec model."""
    shipped = json.loads((MODELS / "spec.schema.json").read_text())
    assert shipped == spec_json_schema()
    assert (MODELS / "SPEC.md").read_text() == spec_reference()


def test_json_schema_accepts_the_shipped_specs_and_refuses_a_bad_one():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(spec_json_schema())
    for path in MODELS.glob("*.yaml"):
        assert not list(validator.iter_errors(yaml.safe_load(path.read_text()))), path.name
    assert list(validator.iter_errors(_edit(["tables", 0, "rows"], -5)))
