"""What ``handlers.modeling.tbe`` relies on in FBGEMM and TorchRec beyond their public API. Each
test fails loudly, naming the assumption, when a new release changes it."""

import pytest
import torch

from handlers.modeling import tbe
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.spec import ShardingType, WeightDtype
from tests.helpers import forward, items_request, model_inputs, sharded, with_tables

from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (  # isort: skip
    IntNBitTableBatchedEmbeddingBagsCodegen as TBE,
)
from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # isort: skip
from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule  # isort: skip
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection  # isort: skip
from torchrec.modules.mc_modules import (  # isort: skip
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor  # isort: skip
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


def test_the_kernel_reads_the_bounds_check_mode_skip_bounds_checks_sets(tiny_spec, tiny_weights, tmp_path):
    """skip_bounds_checks sets FBGEMM's ``bounds_check_mode_int``, which the lookup kernel reads:
    by default it replaces an id past the table with row 0 (and logs); with the check skipped it
    reads the row where the id points, here the zero padding FBGEMM leaves after the table."""
    factory = DLRMFactory(tiny_spec)
    factory.save_weights(tiny_weights, tmp_path / "weights.pt")
    user = factory.tables_layout(tmp_path / "weights.pt").table("t_user")
    following = min(t.offset for t in factory.tables_layout(tmp_path / "weights.pt").tables
                    if t.buffer == user.buffer and t.offset > user.offset)
    assert user.offset + (user.rows + 1) * user.row_bytes <= following, "row `rows` must lie in the padding"
    model = factory.inference_model(tiny_weights)
    ebc = model.sparse_arch.embedding_bag_collection

    def user_embedding(user_id: int) -> torch.Tensor:
        lengths = [int(key == "user_id") for key in tiny_spec.feature_names]
        ids = KeyedJaggedTensor.from_lengths_sync(keys=list(tiny_spec.feature_names), values=torch.tensor([user_id]),
                                                  lengths=torch.tensor(lengths))
        return ebc(ids)["user_id"].clone()

    row_0 = user_embedding(0)
    assert row_0.abs().sum() > 0
    torch.testing.assert_close(user_embedding(user.rows), row_0, rtol=0, atol=0)  # checked: set to row 0
    tbe.skip_bounds_checks(model)
    assert all(m.bounds_check_mode_int == 3 for m in tbe.tbes(model))  # BoundsCheckMode.NONE
    assert torch.equal(user_embedding(user.rows), torch.zeros_like(row_0))  # not checked: read as it lies


def test_named_table_buffers_are_buffers_outside_the_state_dict(tiny_spec, tiny_weights):
    """name_table_buffers turns a TBE's plain tensor attributes into named, non-persistent
    buffers, which torch.export keeps under those names."""
    model = DLRMFactory(tiny_spec).inference_model(tiny_weights)
    tbe.name_table_buffers(model)
    for module in tbe.tbes(model):
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
    # and scores exactly as the same tables unsharded
    unsharded = with_tables(tiny_spec, weight_dtype=WeightDtype.INT8)
    reference = DLRMFactory(unsharded).inference_model(DLRMFactory(unsharded).quantize(DLRMFactory(unsharded).float_model(seed=0)))
    inputs = model_inputs(spec, [items_request(spec, 4, seed=1), items_request(spec, 3, seed=2)])
    torch.testing.assert_close(forward(model, spec, inputs), forward(reference, unsharded, inputs), rtol=0, atol=0)


def test_a_quantized_embedding_collection_keeps_its_tbes_and_per_table_weight_views(tmp_path):
    """refresh_table_views and drop_table_views rely on TorchRec's quantized EmbeddingCollection
    holding its TBEs in ``tbes`` and a ``weight`` view per table in ``embeddings[name]`` (as its
    EmbeddingBagCollection does in ``embedding_bags``); attached rows must show in those views."""
    from din_ranker.train import SPEC

    from handlers.modeling.registry import load_spec
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

    factory = DLRMFactory(load_spec(SPEC))
    factory.save_weights(factory.random_weights(seed=0), tmp_path / "weights.pt")
    model = factory.inference_model(factory.load_weights(tmp_path / "weights.pt"))
    collection = model.item_embeddings
    assert isinstance(collection, QuantEmbeddingCollection)
    assert list(collection.tbes) == tbe.tbes(collection), "TorchRec moved the EC's TBEs out of .tbes"
    view = collection.embeddings["t_item"].weight
    rows = collection.tbes[0].split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)[0][0]
    assert view.data_ptr() == rows.data_ptr(), "the table's weight view no longer shows the attached rows"
    tbe.drop_table_views(model)
    assert "weight" not in dict(collection.embeddings["t_item"].named_buffers(recurse=False))


def test_mch_keeps_its_slot_owners_sorted_beside_their_slots_and_marks_free_ones_with_int64_max():
    """managed_collision_parts and mch_slot_owners rely on TorchRec's managed-collision EBC
    keeping its EBC and MCH modules as ``_embedding_module`` and
    ``_managed_collision_collection._managed_collision_modules``, and on MCH keeping
    ``_mch_sorted_raw_ids`` (free slots: int64 max, ``MCH_FREE_SLOT``) beside
    ``_mch_remapped_ids_mapping`` (each one's slot, from ``_output_global_offset``)."""
    config = EmbeddingBagConfig(name="t", num_embeddings=8, embedding_dim=4, feature_names=["f"])
    ebc = EmbeddingBagCollection(tables=[config])
    mch = MCHManagedCollisionModule(zch_size=8, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
                                    eviction_interval=1)
    mc_ebc = ManagedCollisionEmbeddingBagCollection(ebc, ManagedCollisionCollection({"t": mch}, [config]))
    bags, remaps = tbe.managed_collision_parts(mc_ebc)
    assert bags is ebc and remaps == {"t": mch}
    assert torch.equal(tbe.mch_slot_owners(mch), torch.full((8,), MCH_FREE_SLOT))
    mc_ebc.train()
    ids = torch.tensor([-5, 7, 2**62, -5])
    mc_ebc(KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.tensor([4])))  # an eviction every step
    owners = tbe.mch_slot_owners(mch)
    assert sorted(owners[owners != MCH_FREE_SLOT].tolist()) == [-5, 7, 2**62]
    mc_ebc.eval()
    remapped = mch.remap({"t": JaggedTensor(values=ids, lengths=torch.ones(4, dtype=torch.int64))})["t"].values()
    assert [int(owners[slot]) for slot in remapped] == ids.tolist(), "each id's slot is owned by that id"


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # TorchRec's own constructor
def test_zch_keeps_row_aligned_identities_and_its_lookup_is_fbgemms_read_only_operator():
    """zch_identities relies on TorchRec's ZCH module keeping its identities as
    ``_hash_zch_identities`` (int64 [rows, 1], free slots -1: ``ZCH_EMPTY_SLOT``); zch_slots on
    FBGEMM's ``zero_collision_hash`` answering, read-only, the slots the module's eval remap does
    (buckets: ids split by ``id mod buckets``), and on its meta kernel answering the input itself
    (so the operator gets a copy: traced, the ids stay the ids)."""
    zch = HashZchManagedCollisionModule(zch_size=16, device=torch.device("cpu"), total_num_buckets=2, max_probe=4,
                                        is_inference=True)
    identities = tbe.zch_identities(zch)
    assert identities.shape == (16,) and identities.eq(ZCH_EMPTY_SLOT).all()
    assert identities.data_ptr() == zch._hash_zch_identities.data_ptr(), "not a view of the module's identities"
    ids = torch.tensor([-6, 2**62, 11, 5, -(2**63)])
    starts = torch.remainder(ids, 2) * 8  # bucket 0: slots 0-7, bucket 1: 8-15
    first = tbe.zch_slots(ids, identities, 1, torch.full_like(ids, 8), starts)  # an empty table: where probing starts
    placed = starts[:3] + torch.remainder(first[:3] - starts[:3] + 1, 8)  # each of the first three on its 2nd probe
    identities[placed] = ids[:3]
    expected = zch.remap({"t": JaggedTensor(values=ids, lengths=torch.ones(5, dtype=torch.int64))})["t"].values()
    assert torch.equal(expected[:3], placed), "TorchRec's remap no longer probes as FBGEMM's operator answers"
    assert torch.equal(tbe.zch_slots(ids, identities, 4, torch.full_like(ids, 8), starts), expected)
    fake = torch._subclasses.FakeTensorMode()
    traced, table = fake.from_tensor(ids), fake.from_tensor(identities.view(-1, 1))
    with fake:
        assert torch.ops.fbgemm.zero_collision_hash(traced, table, 4)[0] is traced, "zch_slots's copy may go now"
