"""Zero-collision hashing (``remap: {kind: zch}``) without a GPU: slots assigned as its training's
probing would (``zch_insert``), found by the served remap (``HashRemap``) as TorchRec's module
finds them."""

from __future__ import annotations

import pytest
import torch

from handlers.modeling import tbe
from handlers.modeling.errors import CheckpointError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.raw_ids import HashRemap, random_slot_map, slot_owners, zch_insert
from handlers.modeling.spec import TableSpec
from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT

ROWS, BUCKETS, MAX_PROBE = 512, 4, 8


def _ids(count: int, seed: int) -> torch.Tensor:
    return torch.randint(-(2**63), MCH_FREE_SLOT, (count,), generator=torch.Generator().manual_seed(seed))


def test_inserted_ids_are_found_where_probing_put_them_and_the_rest_had_no_free_slot_in_reach():
    identities = torch.full((ROWS,), ZCH_EMPTY_SLOT, dtype=torch.int64)
    ids = _ids(ROWS + 100, seed=0)  # more ids than slots: some must be left out
    held = zch_insert(identities, ids, MAX_PROBE, BUCKETS)
    inside = torch.isin(ids, identities)
    assert held == int(inside.sum()) == int((identities != ZCH_EMPTY_SLOT).sum()) < len(ids)
    remap = HashRemap(ROWS, MAX_PROBE, BUCKETS)
    remap.load((identities,))
    slots = remap(ids)
    assert torch.equal(identities[slots[inside]], ids[inside])  # every id in the table is found
    assert int(remap.unseen) == int((~inside).sum())
    size = ROWS // BUCKETS
    starts = torch.remainder(ids, BUCKETS) * size
    for k in torch.nonzero(~inside).flatten().tolist():  # left out: every slot it could probe was taken
        reach = starts[k] + torch.remainder(slots[k] - starts[k] + torch.arange(MAX_PROBE), size)
        assert (identities[reach] != ZCH_EMPTY_SLOT).all(), int(ids[k])
        assert slots[k] == reach[0]  # an unseen id looks up the slot its probing starts at
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
    remap = HashRemap(4096, 128, 2)
    remap.load((identities,))
    assert torch.equal(identities[remap(owned)], owned) and int(remap.unseen) == 0


def test_a_zch_checkpoint_whose_slot_holds_the_free_marker_is_refused_naming_the_table(tiny_spec):
    """2^63-1 marks a free slot in slot owners and deltas: a ZCH table holding it is refused at
    build, so on the wire it is an id like any other, and unseen."""
    spec = tiny_spec.replace(tables=[
        {**t.model_dump(mode="json"), "ids": "raw", "remap": {"kind": "zch"}} for t in tiny_spec.tables
    ])
    model = DLRMFactory(spec).float_model(seed=0)
    assert all(o.eq(MCH_FREE_SLOT).all() for o in slot_owners(model).values())  # empty: every slot free
    _, remaps = tbe.managed_collision_parts(model.sparse_arch.embedding_bag_collection.mc_embedding_bag_collection)
    tbe.zch_identities(remaps["t_item"])[3] = MCH_FREE_SLOT
    with pytest.raises(CheckpointError, match=rf"t_item: raw id {MCH_FREE_SLOT} owns slot 3"):
        slot_owners(model)
