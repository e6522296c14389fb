"""Zero-collision hashing (``remap: {kind: zch}``) without a GPU: slots assigned as its training's
probing would (``zch_insert``), found by the served remap (``RawIdRemaps``) as TorchRec's module
finds them."""

from __future__ import annotations

import pytest
import torch

from handlers.modeling import tbe
from handlers.modeling.embedding_modules import bag_configs
from handlers.modeling.errors import CheckpointError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.raw_ids import (
    ManagedBags,
    first_probe_slots,
    random_slot_map,
    served_remap,
    slot_owners,
    zch_insert,
)
from handlers.modeling.spec import TableSpec
from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT

from torchrec import EmbeddingBagCollection, KeyedJaggedTensor  # isort: skip

ROWS, BUCKETS, MAX_PROBE = 512, 4, 8


def _ids(count: int, seed: int) -> torch.Tensor:
    return torch.randint(-(2**63), MCH_FREE_SLOT, (count,), generator=torch.Generator().manual_seed(seed))


def test_inserted_ids_are_found_where_probing_put_them_and_the_rest_had_no_free_slot_in_reach():
    identities = torch.full((ROWS,), ZCH_EMPTY_SLOT, dtype=torch.int64)
    ids = _ids(ROWS + 100, seed=0)  # more ids than slots: some must be left out
    held = zch_insert(identities, ids, MAX_PROBE, BUCKETS)
    inside = torch.isin(ids, identities)
    assert held == int(inside.sum()) == int((identities != ZCH_EMPTY_SLOT).sum()) < len(ids)
    remap = _served(identities, MAX_PROBE, BUCKETS)
    slots = remap.first_feature(ids)
    assert torch.equal(identities[slots[inside]], ids[inside])  # every id in the table is found
    assert remap.counts[:, 0].tolist() == [int((~inside).sum()), len(ids)]
    size = ROWS // BUCKETS
    starts, first = torch.remainder(ids, BUCKETS) * size, first_probe_slots(ids, ROWS, BUCKETS)
    assert torch.equal(starts, (first // size) * size)  # each id probes within its bucket (id mod buckets)
    for k in torch.nonzero(~inside).flatten().tolist():  # left out: every slot it could probe was taken
        reach = starts[k] + torch.remainder(first[k] - starts[k] + torch.arange(MAX_PROBE), size)
        assert (identities[reach] != ZCH_EMPTY_SLOT).all(), int(ids[k])
        assert slots[k] == first[k]  # an unseen id looks up the slot its probing starts at
    before = identities.clone()
    assert zch_insert(identities, ids, MAX_PROBE, BUCKETS) == held and torch.equal(identities, before)


def test_an_earlier_id_takes_a_contested_slot_and_a_later_one_probes_on():
    identities = torch.full((ROWS,), ZCH_EMPTY_SLOT, dtype=torch.int64)
    ids = _ids(4000, seed=1)
    first = tbe.zch_slots(ids, identities, 1)  # one bucket: where each id's probing starts
    a, b = next((i, j) for i in range(len(ids)) for j in range(i + 1, len(ids)) if first[i] == first[j])
    zch_insert(identities, ids[[a, b]], MAX_PROBE, buckets=1)
    assert identities[first[a]] == ids[a] and identities[(first[a] + 1) % ROWS] == ids[b]


def test_a_zch_table_built_without_a_checkpoint_fills_as_training_would():
    table = TableSpec(name="t", rows=4096, dim=8, features=["f"], ids="raw", remap={"kind": "zch", "buckets": 2})
    (identities,) = random_slot_map(table, torch.Generator().manual_seed(2))
    owned = identities[identities != ZCH_EMPTY_SLOT]
    assert 0.9 < len(owned) / 4096 < 1 and len(owned.unique()) == len(owned)
    remap = _served(identities, 128, 2)
    assert torch.equal(identities[remap.first_feature(owned)], owned) and int(remap.counts[0, 0]) == 0


def test_a_zch_checkpoint_whose_slot_holds_the_free_marker_is_refused_naming_the_table(tiny_spec):
    """2^63-1 marks a free slot in slot owners and deltas: a ZCH table holding it is refused
    (the build reads the slot owners), naming the table and the slot."""
    spec = tiny_spec.replace(tables=[
        {**t.model_dump(mode="json"), "ids": "raw", "remap": {"kind": "zch"}} for t in tiny_spec.tables
    ])
    model = DLRMFactory(spec).float_model(seed=0)
    assert all(o.eq(MCH_FREE_SLOT).all() for o in slot_owners(model).values())  # empty: every slot free
    _, remaps = tbe.managed_collision_parts(model.sparse_arch.embedding_bag_collection.mc_embedding_bag_collection)
    tbe.zch_identities(remaps["t_item"])[3] = MCH_FREE_SLOT
    with pytest.raises(CheckpointError, match=rf"t_item: raw id {MCH_FREE_SLOT} owns slot 3"):
        slot_owners(model)


def test_a_zch_checkpoint_loads_without_its_trainings_metadata_and_wrong_settings_are_refused(tiny_spec):
    """A GPU training with eviction saves each ZCH module's metadata: not served, left out on
    load. A spec whose max_probe or buckets are not the training's would find ids elsewhere:
    refused at build, naming the table."""
    spec = tiny_spec.replace(tables=[
        {**t.model_dump(mode="json"), "ids": "raw", "remap": {"kind": "zch", "max_probe": 4, "buckets": 2}}
        for t in tiny_spec.tables
    ])
    factory = DLRMFactory(spec)
    model = factory.float_model(seed=0)
    _, remaps = tbe.managed_collision_parts(model.sparse_arch.embedding_bag_collection.mc_embedding_bag_collection)
    zch_insert(tbe.zch_identities(remaps["t_item"]), _ids(900, seed=3), 4, 2)
    trained = model.state_dict()
    for name, module in remaps.items():
        prefix = next(k for k in trained if k.endswith(f"{name}._hash_zch_identities")).rsplit(".", 1)[0]
        trained[f"{prefix}.{tbe.ZCH_TRAINING_STATE[0]}"] = torch.zeros(len(tbe.zch_identities(module)), 1, dtype=torch.int32)
    loaded = factory.float_model(seed=1)
    factory.load_checkpoint(loaded, trained)
    assert torch.equal(slot_owners(loaded)["t_item"], slot_owners(model)["t_item"])
    for remap in ({"kind": "zch", "max_probe": 4, "buckets": 1}, {"kind": "zch", "max_probe": 1, "buckets": 2}):
        other = DLRMFactory(spec.replace(tables=[{**t.model_dump(mode="json"), "remap": remap} for t in spec.tables]))
        wrong = other.float_model(seed=0)
        other.load_checkpoint(wrong, trained)
        with pytest.raises(CheckpointError, match=r"t_item: \d+ of its \d+ raw ids are not where probing"):
            slot_owners(wrong)


def test_a_slot_map_of_the_other_kind_is_refused_by_name():
    ids = _ids(8, seed=4)
    zch = TableSpec(name="z", rows=8, dim=8, features=["f"], ids="raw", remap={"kind": "zch", "max_probe": MAX_PROBE})
    with pytest.raises(ValueError, match=r"tables \['z'\]: their slot maps must be identities, got 2 part"):
        served_remap(zch).load({"z": (ids, torch.arange(8))})
    mch = TableSpec(name="m", rows=8, dim=8, features=["f"], ids="raw", remap={"kind": "mch"})
    with pytest.raises(ValueError, match=r"tables \['m'\]: their slot maps must be sorted_ids and slots, got 1 part"):
        served_remap(mch).load({"m": (ids,)})


def _served(identities: torch.Tensor, max_probe: int, buckets: int):
    """The served remap of a ZCH table holding ``identities``."""
    table = TableSpec(name="t", rows=len(identities), dim=8, features=["f"], ids="raw",
                      remap={"kind": "zch", "max_probe": max_probe, "buckets": buckets})
    remap = served_remap(table)
    remap.load({"t": (identities,)})
    return remap


def test_a_zero_zch_tables_unseen_ids_leave_their_bags_with_their_weights_in_the_float_model():
    """``ManagedBags.without_unseen`` (the float side of ``unseen: zero``): in a weighted
    collection, the unseen ids of a ZCH ``zero`` table (both its features) go with their weights
    and their bags shrink; an MCH table's unseen ids stay (its default row takes them). (A
    training, which keeps every id, cannot run here: FBGEMM's CPU ZCH kernel only looks up.)"""
    tables = [
        TableSpec(name="t_z", rows=64, dim=4, features=["fz", "fz2"], ids="raw",
                  remap={"kind": "zch", "max_probe": MAX_PROBE, "unseen": "zero"}),
        TableSpec(name="t_m", rows=16, dim=4, features=["fm"], ids="raw", remap={"kind": "mch"}),
    ]
    bags = ManagedBags(EmbeddingBagCollection(tables=bag_configs(tables), is_weighted=True), tables,
                       torch.device("cpu")).eval()
    _, remaps = tbe.managed_collision_parts(bags.mc_embedding_bag_collection)
    owned = _ids(20, seed=7)
    zch_insert(tbe.zch_identities(remaps["t_z"]), owned, MAX_PROBE, 1)
    owned = owned[torch.isin(owned, tbe.zch_identities(remaps["t_z"]))]
    unseen = _ids(4, seed=8)
    # keys fz, fz2, fm; two items each: bags [o0 u0 o1] [u1] | [o2] [u2 o3] | [u3 u0] []
    values = torch.stack([owned[0], unseen[0], owned[1], unseen[1], owned[2], unseen[2], owned[3], unseen[3], unseen[0]])
    lengths = torch.tensor([3, 1, 1, 2, 2, 0])
    weights = torch.arange(1.0, 10.0)
    features = KeyedJaggedTensor(keys=["fz", "fz2", "fm"], values=values, lengths=lengths, weights=weights)
    kept = bags.without_unseen(features)
    assert kept.lengths().tolist() == [2, 0, 1, 1, 2, 0]
    assert torch.equal(kept.values(), torch.stack([owned[0], owned[1], owned[2], owned[3], unseen[3], unseen[0]]))
    assert kept.weights().tolist() == [1.0, 3.0, 5.0, 7.0, 8.0, 9.0]
    torch.testing.assert_close(bags(features).values(), bags(kept).values())
