"""The factory: served models from a spec (quantized, sharded, lower-precision dense layers) score
within stated bounds of the float model, and run on the memory-mapped weights file in place."""

import copy

import pytest
import torch
from torchrec.inference.modules import quantize_inference_model
from torchrec.models.dlrm import DLRMTrain

from handlers.modeling.checkpoint import read_checkpoint
from handlers.modeling.dense_precision import CastTo
from handlers.modeling.errors import CheckpointError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.spec import CheckpointMapping, DensePrecision, Pooling, ShardingType, WeightDtype
from handlers.modeling.tbe import tbes
from handlers.modeling.weights import InferenceWeights
from torchrec import KeyedJaggedTensor
from tests.helpers import forward, items_request, model_inputs, sharded, with_tables

# Largest |score - float score| over 128 multi-hot items of the seeded tiny model. Measured worst
# over seeds 0-4: fp32 0, fp16 1.2e-6, int8 2.2e-5, int4 4.2e-4, int2 8.3e-4; bounds leave ~10x
# headroom.
SCORE_BOUND = {
    WeightDtype.FP32: 1e-6,
    WeightDtype.FP16: 1e-5,
    WeightDtype.INT8: 2e-4,
    WeightDtype.INT4: 4e-3,
    WeightDtype.INT2: 8e-3,
}


def _scores(model, spec, inputs):
    return torch.sigmoid(forward(model, spec, inputs))


@pytest.mark.parametrize("dtype", list(WeightDtype))
@pytest.mark.parametrize("seed", [0, 1])
def test_quantized_scores_within_bound_of_float(tiny_spec, dtype, seed):
    spec = with_tables(tiny_spec, weight_dtype=dtype)
    factory = DLRMFactory(spec)
    float_model = factory.float_model(seed=seed)
    served = factory.inference_model(factory.quantize(float_model))
    inputs = model_inputs(spec, [items_request(spec, 128, seed=seed + 10, max_bag=8)])
    diff = (_scores(served, spec, inputs) - _scores(float_model, spec, inputs)).abs().max().item()
    assert diff <= SCORE_BOUND[dtype]
    if dtype != WeightDtype.FP32:
        assert diff > 0, "a quantized table should not be bit-identical to float"


def test_inference_model_equals_torchrec_quantization(tiny_spec, tiny_float_model, tiny_weights):
    """Building the tables directly in quantized form computes what TorchRec's module swap does."""
    factory = DLRMFactory(tiny_spec)
    reference = quantize_inference_model(
        copy.deepcopy(tiny_float_model),
        per_table_weight_dtype={
            "t_user": torch.qint8,
            "t_item": torch.quint4x2,
            "t_category": torch.float16,
            "t_hour": torch.float32,
        },
    )
    inputs = model_inputs(tiny_spec, [items_request(tiny_spec, 32, seed=3)])
    assert torch.equal(
        forward(factory.inference_model(tiny_weights), tiny_spec, inputs),
        forward(reference, tiny_spec, inputs),
    )


@pytest.mark.parametrize(
    "world_size, sharding",
    [
        (2, ShardingType.TABLE_WISE),
        (2, ShardingType.ROW_WISE),
        (2, ShardingType.AUTO),
        (3, ShardingType.ROW_WISE),
        (1, ShardingType.TABLE_WISE),
    ],
)
def test_sharded_equals_unsharded(tiny_spec, world_size, sharding):
    # Row-wise sharding needs sum pooling and int tables (handlers.spec refuses the rest).
    spec = with_tables(tiny_spec, weight_dtype=WeightDtype.INT8, pooling=Pooling.SUM)
    float_model = DLRMFactory(spec).float_model(seed=4)
    weights = DLRMFactory(spec).quantize(float_model)
    unsharded = DLRMFactory(spec).inference_model(weights)
    sharded_model = DLRMFactory(sharded(spec, world_size, sharding)).inference_model(weights)
    assert any("Sharded" in type(m).__name__ for m in sharded_model.modules())
    inputs = model_inputs(spec, [items_request(spec, 64, seed=5, max_bag=6)])
    assert torch.equal(forward(sharded_model, spec, inputs), forward(unsharded, spec, inputs))


def test_weights_round_trip_through_file(tiny_spec, tiny_weights, tmp_path):
    factory = DLRMFactory(tiny_spec)
    factory.save_weights(tiny_weights, tmp_path / "weights.pt")
    loaded = factory.load_weights(tmp_path / "weights.pt")
    inputs = model_inputs(tiny_spec, [items_request(tiny_spec, 16, seed=6)])
    assert torch.equal(
        forward(factory.inference_model(loaded), tiny_spec, inputs),
        forward(factory.inference_model(tiny_weights), tiny_spec, inputs),
    )


@pytest.mark.parametrize("mapping", [None, {"model.": ""}], ids=["detected", "mapped"])
def test_dlrm_train_checkpoint_loads(tiny_spec, tiny_float_model, tmp_path, mapping):
    """TorchRec's training wrapper ``DLRMTrain`` keeps the model under ``model.``: detected and
    stripped without a mapping, or stripped by the spec's; every trained tensor arrives."""
    checkpoint = DLRMTrain(copy.deepcopy(tiny_float_model)).state_dict()
    assert all(k.startswith("model.") for k in checkpoint)
    torch.save({"state_dict": checkpoint}, tmp_path / "ckpt.pt")
    spec = _with_mapping(tiny_spec, mapping) if mapping else tiny_spec
    factory = DLRMFactory(spec)
    model = factory.float_model(seed=99)
    note = factory.load_checkpoint(model, read_checkpoint(tmp_path / "ckpt.pt"))
    assert note == (None if mapping else "stripped the prefix 'model.' of TorchRec's DLRMTrain's wrapper")
    for key, value in tiny_float_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_prefix_that_leaves_names_unmatched_is_not_stripped(tiny_spec, tiny_float_model):
    checkpoint = {f"module.{k}": v for k, v in tiny_float_model.state_dict().items()}
    checkpoint["module.extra.bias"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="unexpected: module.dense_arch"):
        DLRMFactory(tiny_spec).load_checkpoint(DLRMFactory(tiny_spec).float_model(seed=0), checkpoint)


def test_checkpoint_with_renamed_table_loads_through_mapping(tiny_spec, tiny_float_model):
    ebc = "sparse_arch.embedding_bag_collection.embedding_bags."
    checkpoint = {
        k.replace(ebc + "t_user.", ebc + "users."): v for k, v in tiny_float_model.state_dict().items()
    }
    spec = _with_mapping(tiny_spec, {ebc + "users.": ebc + "t_user."})
    model = DLRMFactory(spec).float_model(seed=99)
    DLRMFactory(spec).load_checkpoint(model, checkpoint)
    assert torch.equal(model.state_dict()[ebc + "t_user.weight"], checkpoint[ebc + "users.weight"])


def test_checkpoint_errors_list_every_bad_key(tiny_spec, tiny_float_model):
    checkpoint = dict(tiny_float_model.state_dict())
    ebc = "sparse_arch.embedding_bag_collection.embedding_bags."
    del checkpoint[ebc + "t_hour.weight"]
    checkpoint["extra.bias"] = torch.zeros(3)
    checkpoint[ebc + "t_user.weight"] = torch.zeros(999, 8)
    factory = DLRMFactory(tiny_spec)
    with pytest.raises(CheckpointError) as error:
        factory.load_checkpoint(factory.float_model(seed=0), checkpoint)
    message = str(error.value)
    assert f"missing: {ebc}t_hour.weight" in message
    assert "unexpected: extra.bias" in message
    assert f"mis-shaped: {ebc}t_user.weight: checkpoint (999, 8) vs model (1000, 8)" in message


def test_checkpoint_that_is_not_a_state_dict(tmp_path):
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="expected a state dict of tensors"):
        read_checkpoint(tmp_path / "list.pt")


def test_inference_weights_for_other_tables_are_refused(tiny_spec, tiny_weights):
    weights = InferenceWeights(
        tables={k: v for k, v in tiny_weights.tables.items() if k != "t_hour"}, dense=tiny_weights.dense
    )
    with pytest.raises(CheckpointError, match="the spec has"):
        DLRMFactory(tiny_spec).inference_model(weights)


def _with_mapping(spec, prefixes):
    return spec.replace(checkpoint_mapping=CheckpointMapping(prefixes=prefixes))


# -- the context ranker ----------------------------------------------------------------------


def test_ranker_quantized_scores_within_bound_of_float(ranker_spec, ranker_float_model, ranker_weights):
    """int8, int4 and fp16 tables together: bounded by the loosest (int4) table's bound."""
    served = DLRMFactory(ranker_spec).inference_model(ranker_weights)
    inputs = model_inputs(ranker_spec, [items_request(ranker_spec, 128, seed=s, max_bag=8) for s in range(3)])
    diff = (
        _scores(served, ranker_spec, inputs) - _scores(ranker_float_model, ranker_spec, inputs)
    ).abs().max().item()
    assert 0 < diff <= SCORE_BOUND[WeightDtype.INT4]


@pytest.mark.parametrize("served", [False, True], ids=["float", "quantized"])
def test_ranker_id_weight_scales_its_embedding(ranker_spec, ranker_float_model, ranker_weights, served):
    """Sum pooling with weights: an id with weight 2 scores as that id given twice."""
    model = DLRMFactory(ranker_spec).inference_model(ranker_weights) if served else ranker_float_model
    context = [0.3] * ranker_spec.context_features

    def score(tags):
        item = {"dense": [0.1, 0.2, 0.3], "sparse": {"item_id": [5], "item_tags": tags}}
        return forward(model, ranker_spec, model_inputs(ranker_spec, [{"context": context, "items": [item]}]))

    twice = score([17, 17])
    torch.testing.assert_close(score({"ids": [17], "weights": [2.0]}), twice, atol=1e-6, rtol=0)
    assert not torch.allclose(score([17]), twice)


def test_ranker_context_changes_only_its_own_requests_scores(ranker_spec, ranker_weights):
    """The context is computed once per request and broadcast to that request's candidates only."""
    model = DLRMFactory(ranker_spec).inference_model(ranker_weights)
    first = items_request(ranker_spec, 3, seed=1)
    second = items_request(ranker_spec, 4, seed=2)
    before = forward(model, ranker_spec, model_inputs(ranker_spec, [first, second]))
    after = forward(
        model, ranker_spec, model_inputs(ranker_spec, [{**first, "context": [9.0] * 8}, second])
    )
    assert not torch.allclose(before[:3], after[:3])
    assert torch.equal(before[3:], after[3:])


# -- the weights file: FBGEMM's own layout, memory-mapped, run without a copy -----------------


def test_loaded_tables_are_the_mapped_file_not_a_copy(tiny_spec, tiny_weights, tmp_path):
    factory = DLRMFactory(tiny_spec)
    factory.save_weights(tiny_weights, tmp_path / "weights.pt")
    loaded = factory.load_weights(tmp_path / "weights.pt")
    model = factory.inference_model(loaded)
    hosts = [tbe.weights_host for tbe in tbes(model)]
    assert [h.data_ptr() for h in hosts] == [b.data_ptr() for b in loaded.buffers]
    assert all(not h.untyped_storage().resizable() for h in hosts), "mmapped storage is not resizable"
    # what state_dict shows is the same memory
    state = model.state_dict()
    user = state["sparse_arch.embedding_bag_collection.embedding_bags.t_user.weight"]
    assert hosts[0].data_ptr() <= user.data_ptr() < hosts[0].data_ptr() + hosts[0].numel()


def test_rows_are_packed_to_4_bytes(tiny_spec, tiny_weights):
    """int8 dim 8: 4 bytes of scale/bias + 8 values = 12 bytes a row, not padded to 16; FBGEMM only
    starts each table on a 64-byte cache line."""
    spec = with_tables(tiny_spec, weight_dtype=WeightDtype.INT8)
    model = DLRMFactory(spec).inference_model(DLRMFactory(spec).quantize(DLRMFactory(spec).float_model(seed=0)))
    packed = 12 * sum(t.rows for t in spec.tables)
    assert packed <= sum(tbe.host_size for tbe in tbes(model)) < packed + 64 * len(spec.tables)


@pytest.mark.parametrize("dtype", list(WeightDtype))
def test_random_weights_dequantize_within_init_bound(tiny_spec, dtype, tmp_path):
    """Tables created straight in their served dtype; a one-id bag returns its dequantized row."""
    spec = with_tables(tiny_spec, weight_dtype=dtype, pooling=Pooling.SUM)
    factory = DLRMFactory(spec)
    weights = factory.random_weights(seed=3)
    factory.save_weights(weights, tmp_path / "weights.pt")
    model = factory.inference_model(factory.load_weights(tmp_path / "weights.pt"))
    ebc = model.sparse_arch.embedding_bag_collection
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=list(spec.feature_names),
        values=torch.tensor([rows - 1 for rows in spec.feature_rows]),
        lengths=torch.ones(len(spec.feature_names), dtype=torch.int64),
    )
    pooled = ebc(features).to_dict()
    for table in spec.tables:
        row = pooled[table.features[0]]
        bound = table.rows**-0.5
        assert row.abs().max() <= bound * 1.001 and row.abs().max() > bound / 4, (table.name, row)
    assert torch.isfinite(forward(model, spec, model_inputs(spec, [items_request(spec, 8, seed=1)]))).all()


def test_random_weights_never_build_float_tables(tiny_spec, monkeypatch):
    original = torch.nn.EmbeddingBag.reset_parameters
    devices = []

    def recording(bag):
        devices.append(bag.weight.device.type)
        original(bag)

    monkeypatch.setattr(torch.nn.EmbeddingBag, "reset_parameters", recording)
    DLRMFactory(tiny_spec).random_weights(seed=0)
    assert devices and set(devices) == {"meta"}, "float tables may only exist as shapes on meta"


# -- dense submodules in lower precision -------------------------------------------------------

# Largest |score - float score| over 128 items of the tiny model with fp32 tables, both MLPs in the
# given precision. Measured worst over seeds 0-2: bf16 2.8e-4, fp16 3.9e-5, int8 weight-only 9.0e-5,
# int8 dynamic 3.3e-4; the bounds leave ~10x headroom.
DENSE_BOUND = {
    DensePrecision.BF16: 3e-3,
    DensePrecision.FP16: 4e-4,
    DensePrecision.INT8_WEIGHT_ONLY: 1e-3,
    DensePrecision.INT8_DYNAMIC: 4e-3,
}


@pytest.mark.parametrize("precision", list(DENSE_BOUND))
def test_dense_precision_within_bound_of_float(tiny_spec, precision):
    spec = with_tables(tiny_spec, weight_dtype=WeightDtype.FP32).replace(
        dense_precision={"dense_arch": precision, "over_arch": precision}
    )
    factory = DLRMFactory(spec)
    float_model = factory.float_model(seed=0)
    served = factory.inference_model(factory.quantize(float_model))
    for name in ("dense_arch", "over_arch"):
        assert _linear_weight_kinds(getattr(served, name)) == {EXPECTED_WEIGHTS[precision]}, name
    inputs = model_inputs(spec, [items_request(spec, 128, seed=4, max_bag=6)])
    diff = (_scores(served, spec, inputs) - _scores(float_model, spec, inputs)).abs().max().item()
    assert 0 < diff <= DENSE_BOUND[precision], diff


# What each precision leaves in a served submodule's Linear layers: a cast copy's dtype, or
# TorchAO's int8 tensor subclass (weight-only and dynamic differ in how activations are handled).
EXPECTED_WEIGHTS = {
    DensePrecision.BF16: "torch.bfloat16",
    DensePrecision.FP16: "torch.float16",
    DensePrecision.INT8_WEIGHT_ONLY: "int8 (torchao)",
    DensePrecision.INT8_DYNAMIC: "int8 (torchao)",
}


def _linear_weight_kinds(module: torch.nn.Module) -> set[str]:
    kinds = set()
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            weight = layer.weight
            plain = type(weight) in (torch.Tensor, torch.nn.Parameter)
            kinds.add(str(weight.dtype) if plain else "int8 (torchao)")
    if isinstance(module, CastTo):
        assert module.dtype == getattr(torch, next(iter(kinds)).removeprefix("torch."))
    return kinds


def test_weights_file_of_another_layout_is_refused(tiny_spec, tiny_weights, tmp_path):
    """An old per-table file, or buffers of the wrong size, name what the spec needs."""
    torch.save({"tables.t_user.rows": torch.zeros(3, 12, dtype=torch.uint8)}, tmp_path / "old.pt")
    with pytest.raises(CheckpointError, match="holds \\[\\], the spec needs 2 TBE buffers"):
        DLRMFactory(tiny_spec).load_weights(tmp_path / "old.pt")
    factory = DLRMFactory(tiny_spec)
    factory.save_weights(tiny_weights, tmp_path / "weights.pt")
    flat = torch.load(tmp_path / "weights.pt", weights_only=True)
    flat["tbe.0"] = flat["tbe.0"][:-4].clone()
    torch.save(flat, tmp_path / "short.pt")
    with pytest.raises(CheckpointError, match="must be uint8 \\["):
        factory.load_weights(tmp_path / "short.pt")
