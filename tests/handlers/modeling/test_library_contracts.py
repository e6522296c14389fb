"""What ``handlers.modeling.tbe`` relies on in FBGEMM and TorchRec beyond their public API. Each
test fails loudly, naming the assumption, when a new release changes it."""

import torch

from handlers.modeling import tbe
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.spec import ShardingType, WeightDtype
from tests.helpers import forward, items_request, model_inputs, sharded, with_tables

from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (  # isort: skip
    IntNBitTableBatchedEmbeddingBagsCodegen as TBE,
)
from torchrec import KeyedJaggedTensor  # isort: skip
from torchrec.distributed import global_settings  # isort: skip


def test_quantized_ebc_fills_its_tbes_through_initialize_weights(tiny_spec):
    """deferred_tbe_weights relies on TorchRec calling ``initialize_weights`` per TBE while it
    builds a quantized EBC, and on FBGEMM keeping host weights in ``weights_host``."""
    original = TBE.initialize_weights
    model = DLRMFactory(tiny_spec)._quant_model(torch.device("cpu"))
    assert TBE.initialize_weights is original, "the deferral must restore FBGEMM"
    modules = tbe.tbes(model)
    assert modules, "TorchRec no longer registers its TBEs as submodules (register_tbes)"
    for module in modules:
        assert module.weights_host.device.type == "meta", "initialize_weights was not deferred"
        assert module.host_size > 0 and module.dev_size == 0 and module.uvm_size == 0


def test_an_attached_buffer_is_what_the_kernels_read(tiny_spec, tiny_weights, tmp_path):
    """attach relies on the lookup kernels reading ``weights_host`` after
    ``initialize_logical_weights_placements_and_offsets``: changing the buffer changes scores."""
    factory = DLRMFactory(tiny_spec)
    factory.save_weights(tiny_weights, tmp_path / "weights.pt")
    weights = factory.load_weights(tmp_path / "weights.pt")
    model = factory.inference_model(weights)
    ebc = model.sparse_arch.embedding_bag_collection
    ids = KeyedJaggedTensor.from_lengths_sync(
        keys=list(tiny_spec.feature_names),
        values=torch.tensor([3, 4, 5, 6, 7]),
        lengths=torch.ones(5, dtype=torch.int64),
    )
    before = ebc(ids).values().clone()
    for buffer in weights.buffers:
        buffer.zero_()  # copy-on-write pages of the private mapping; the file is untouched
    assert not torch.equal(ebc(ids).values(), before)
    assert all(m.weights_host.data_ptr() == b.data_ptr() for m, b in zip(tbe.tbes(model), weights.buffers))


def test_bounds_check_mode_and_table_names_for_export(tiny_spec, tiny_weights):
    """skip_bounds_checks sets FBGEMM's ``bounds_check_mode_int``; name_table_buffers turns its
    plain tensor attributes into named, non-persistent buffers."""
    model = DLRMFactory(tiny_spec).inference_model(tiny_weights)
    modules = tbe.tbes(model)
    assert all(isinstance(m.bounds_check_mode_int, int) for m in modules)
    tbe.skip_bounds_checks(model)
    tbe.name_table_buffers(model)
    for module in modules:
        assert module.bounds_check_mode_int == 3  # BoundsCheckMode.NONE
        assert {"weights_host", "weights_placements", "weights_offsets"} <= set(
            dict(module.named_buffers(recurse=False))
        )
        assert "weights_host" not in module.state_dict()


def test_sharding_leaves_torchrecs_device_setting_as_it_was(tiny_spec, tiny_weights):
    """TorchRec reads its process-wide ``propogate_device`` when sharded modules build their parts;
    the factory sets it only while sharding, and the model still runs on the cpu afterwards."""
    before = global_settings.get_propogate_device()
    spec = sharded(with_tables(tiny_spec, weight_dtype=WeightDtype.INT8), 2, ShardingType.TABLE_WISE)
    weights = DLRMFactory(spec).quantize(DLRMFactory(spec).float_model(seed=0))
    model = DLRMFactory(spec).inference_model(weights)
    assert global_settings.get_propogate_device() == before
    assert any("Sharded" in type(m).__name__ for m in model.modules())
    inputs = model_inputs(spec, [items_request(spec, 4, seed=1)])
    assert torch.isfinite(forward(model, spec, inputs)).all()
