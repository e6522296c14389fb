import copy

import pytest
import yaml

from handlers.errors import SpecError
from handlers.spec import ModelSpec, OutOfRangePolicy, Pooling, WeightDtype
from handlers.spec import Architecture
from tests.conftest import CRITEO_SPEC, RANKER_SPEC, TINY_SPEC


def test_tiny_spec_loads_typed(tiny_spec):
    assert tiny_spec.feature_names == ("user_id", "item_id", "last_item_id", "category", "hour")
    assert tiny_spec.feature_rows == (1000, 500, 500, 50, 24)
    assert tiny_spec.tables[1].weight_dtype == WeightDtype.INT4
    assert tiny_spec.tables[2].pooling == Pooling.MEAN
    assert not tiny_spec.is_sharded


def test_criteo_spec_has_criteo_shape():
    spec = ModelSpec.from_yaml(CRITEO_SPEC)
    assert spec.dense_features == 13
    assert spec.feature_names == tuple(f"cat_{i}" for i in range(26))
    assert spec.bottom_mlp == (512, 256, 64) and spec.top_mlp == (512, 512, 256, 1)
    assert spec.out_of_range == OutOfRangePolicy.HASH


def test_ranker_spec_loads_typed(ranker_spec):
    assert ranker_spec.architecture == Architecture.CONTEXT_RANKER
    assert ranker_spec.context_features == 8 and ranker_spec.context_mlp == (16, 8)
    assert ranker_spec.weighted_ids
    # No DLRM dot products here: tables may have dims of their own.
    assert [t.dim for t in ranker_spec.tables] == [16, 8, 4]


@pytest.mark.parametrize("spec_path", [TINY_SPEC, RANKER_SPEC])
def test_round_trips_through_yaml(spec_path, tmp_path):
    spec = ModelSpec.from_yaml(spec_path)
    spec.to_yaml(tmp_path / "spec.yaml")
    assert ModelSpec.from_yaml(tmp_path / "spec.yaml") == spec


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("context_features", "delete", "spec.context_features: required key is missing"),
        ("context_mlp", [8, 0], "spec.context_mlp[1]: must be a positive integer"),
        ("weighted_ids", "yes", "spec.weighted_ids: must be true or false"),
        ("architecture", "two_tower", "spec.architecture: must be one of dlrm, context_ranker"),
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
        ModelSpec.from_dict(raw)
    assert message in str(error.value)


def test_dlrm_spec_refuses_context_keys():
    raw = yaml.safe_load(TINY_SPEC.read_text())
    raw["context_features"] = 8
    with pytest.raises(SpecError, match="spec: unknown key\\(s\\) 'context_features'"):
        ModelSpec.from_dict(raw)


def _raw():
    return yaml.safe_load(TINY_SPEC.read_text())


def _edit(path, value):
    raw = _raw()
    target = raw
    *parents, last = path
    for key in parents:
        target = target[key]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return raw


_DELETE = object()


@pytest.mark.parametrize(
    "path, value, message",
    [
        (["name"], _DELETE, "spec.name: required key is missing"),
        (["dense_features"], 0, "spec.dense_features: must be a positive integer"),
        (["dense_features"], True, "spec.dense_features: must be a positive integer"),
        (["bottom_mlp"], [16, "8"], "spec.bottom_mlp[1]: must be a positive integer"),
        (["top_mlp"], [16, 2], "top_mlp: last layer must be 1"),
        (["tables"], [], "spec.tables: must be a non-empty list"),
        (["tables", 0, "dim"], 4, "tables[0].dim: must equal bottom_mlp[-1] (8)"),
        (["tables", 0, "weight_dtype"], "int2", "tables[0].weight_dtype: must be one of fp32, fp16, int8, int4"),
        (["tables", 0, "pooling"], "max", "tables[0].pooling: must be one of sum, mean"),
        (["tables", 0, "rows"], -5, "tables[0].rows: must be a positive integer"),
        (["tables", 0, "colour"], "red", "tables[0]: unknown key(s) 'colour'"),
        (["tables", 1, "name"], "t_user", "tables[1].name: duplicate table name"),
        (["tables", 1, "features"], ["user_id"], "tables[1].features: feature 'user_id' is used by two tables"),
        (["tables", 0, "sharding"], "column_wise", "tables[0].sharding: column_wise sharding"),
        (["tables", 2, "sharding"], "row_wise", "tables[2].sharding: row_wise sharding gives wrong results with mean"),
        (["sharding"], {"device": "tpu"}, "sharding.device: must be 'cpu' or 'cuda'"),
        (["sharding"], {"world_size": 2}, "tables[2].weight_dtype: a sharded model needs int8 or int4"),
        (["out_of_range"], "clip", "spec.out_of_range: must be one of reject, hash"),
        (["limits", "max_items_per_request"], 5000, "limits.max_items_per_request: must not exceed"),
        (["limits", "max_ids"], 3, "limits: unknown key(s) 'max_ids'"),
        (["checkpoint_mapping"], {"prefixes": {"module.": 3}}, "checkpoint_mapping.prefixes: must map"),
        (["extra"], 1, "spec: unknown key(s) 'extra'"),
        (["dense_precision"], {"over_arch": "int2"}, "dense_precision.over_arch: must be one of fp32, bf16"),
        (["dense_precision"], {"context_arch": "bf16"}, "dense_precision.context_arch: not a dense submodule of dlrm"),
    ],
)
def test_bad_spec_names_the_key(path, value, message):
    with pytest.raises(SpecError) as error:
        ModelSpec.from_dict(_edit(path, value))
    assert message in str(error.value)


def test_not_a_mapping():
    with pytest.raises(SpecError, match="spec: must be a mapping"):
        ModelSpec.from_dict(["name"])


def test_invalid_yaml(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        ModelSpec.from_yaml(tmp_path / "bad.yaml")


def test_checkpoint_mapping_applies_prefixes_in_order():
    raw = _raw()
    raw["checkpoint_mapping"] = {"prefixes": {"module.": "", "sparse.old.": "sparse.new."}}
    mapping = ModelSpec.from_dict(copy.deepcopy(raw)).checkpoint_mapping
    assert mapping.apply("module.sparse.old.weight") == "sparse.new.weight"
    assert mapping.apply("dense.weight") == "dense.weight"
