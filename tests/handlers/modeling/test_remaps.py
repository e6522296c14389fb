"""The served remap of a raw-id collection (``RawIdRemaps``): every table's ids in one call give
the slots each table's own search gives (``torch.searchsorted`` on an MCH table's sorted owners,
FBGEMM's probing of a ZCH table alone), and the ids it counts unseen are those that own no slot;
an MCH bucket index made before a delta moved the owners changes none of it."""

from __future__ import annotations

import pytest
import torch

from handlers.modeling.raw_ids import random_slot_map, zch_lookup
from handlers.modeling.remaps import RawIdRemaps
from handlers.modeling.spec import TableSpec
from handlers.runtime.id_buckets import index_of, refresh
from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT
from handlers.runtime.slot_maps import fused, owners_of, slot_map, spanned, with_owners

# both kinds, two ZCH probe lengths, buckets, a table of two features, tables of one and two slots,
# both kinds with unseen: zero (MCH: its default slot, the row held at zero; ZCH: no slot, -1), MCH
# tables of many buckets (16 owners each, on average), one starting at an odd slot (1010)
TABLES = [
    TableSpec(name="a", rows=1000, dim=8, features=["fa"], ids="raw", remap={"kind": "mch"}),
    TableSpec(name="z", rows=512, dim=8, features=["fz", "fz2"], ids="raw",
              remap={"kind": "zch", "max_probe": 16, "buckets": 2}),
    TableSpec(name="b", rows=7, dim=8, features=["fb"], ids="raw", remap={"kind": "mch", "unseen": "zero"}),
    TableSpec(name="y", rows=300, dim=8, features=["fy"], ids="raw",
              remap={"kind": "zch", "max_probe": 8, "unseen": "zero"}),
    TableSpec(name="c", rows=1, dim=8, features=["fc"], ids="raw", remap={"kind": "mch"}),
    TableSpec(name="d", rows=2, dim=8, features=["fd"], ids="raw", remap={"kind": "mch"}),
    TableSpec(name="e", rows=1500, dim=8, features=["fe"], ids="raw", remap={"kind": "mch"}),
]
COUNTED = ["a", "b", "c", "d", "e", "other", "y", "z"]  # the model's raw-id tables: one is another collection's


def _table_search(table: TableSpec, slot_map, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One table's slots and which ids own one, by that table's own search."""
    if table.remap.kind == "zch":
        (identities,) = slot_map
        slots = zch_lookup(ids, identities, table.remap.max_probe, table.remap.buckets)
        owned = identities[slots] == ids
        return torch.where(owned | (table.remap.unseen != "zero"), slots, -1), owned
    sorted_ids, slots = slot_map
    found = torch.searchsorted(sorted_ids[:-1], ids)
    owned = sorted_ids[found] == ids
    return torch.where(owned, slots[found], table.rows - 1), owned


def test_every_tables_ids_in_one_call_get_their_own_tables_slots_and_unseen_ones_are_counted():
    generator = torch.Generator().manual_seed(0)
    maps = {t.name: random_slot_map(t, generator) for t in TABLES}
    for full in ("b", "d"):  # every slot owned, the last too: a search must stop at its table's end
        owners = torch.randint(-(2**63), MCH_FREE_SLOT, (len(maps[full][0]),), generator=generator)
        maps[full] = slot_map(owners)
    remap = RawIdRemaps(TABLES, COUNTED)
    remap.load(fused(dict(maps), [t.name for t in TABLES]))  # maps keeps each table's own tensors
    features = [(t, f) for t in TABLES for f in t.features]
    assert remap.features == [f for _, f in features]
    everyones = torch.cat([m[0] for m in maps.values()])  # other tables' owners: unseen in this one
    for _ in range(40):
        ids, lengths, expected = [], [], []
        unseen = dict.fromkeys(COUNTED, 0)
        looked_up = dict.fromkeys(COUNTED, 0)
        for table, _ in features:
            n = int(torch.randint(0, 6, (1,), generator=generator))
            owners = maps[table.name][0]
            held = owners[torch.randint(0, len(owners), (n,), generator=generator)]
            anywhere = torch.randint(-(2**63), MCH_FREE_SLOT, (n,), generator=generator)
            elsewhere = everyones[torch.randint(0, len(everyones), (n,), generator=generator)]
            pick = torch.rand(n, generator=generator)
            drawn = torch.where(pick < 0.4, held, torch.where(pick < 0.7, elsewhere, anywhere))
            drawn = drawn[(drawn != MCH_FREE_SLOT) & (drawn != ZCH_EMPTY_SLOT)]  # the wire refuses both
            slots, owned = _table_search(table, maps[table.name], drawn)
            ids.append(drawn), lengths.append(len(drawn)), expected.append(slots)
            unseen[table.name] += int((~owned).sum())
            looked_up[table.name] += len(drawn)
        before = remap.counts.clone()
        assert torch.equal(remap(torch.cat(ids), torch.tensor(lengths)), torch.cat(expected))
        grown = (remap.counts - before).tolist()
        assert grown == [[unseen[t] for t in COUNTED], [looked_up[t] for t in COUNTED]]


def test_zch_tables_alike_drop_the_unseen_ids_of_the_zero_ones_alone():
    """Every table ZCH with one max_probe (one FBGEMM call, no gather): a ``unseen: zero`` table's
    unseen ids get slot -1, the other table's their first probe slot."""
    tables = [
        TableSpec(name="p", rows=64, dim=8, features=["fp"], ids="raw", remap={"kind": "zch", "max_probe": 4}),
        TableSpec(name="q", rows=64, dim=8, features=["fq"], ids="raw",
                  remap={"kind": "zch", "max_probe": 4, "unseen": "zero"}),
    ]
    generator = torch.Generator().manual_seed(2)
    maps = {t.name: random_slot_map(t, generator) for t in tables}
    remap = RawIdRemaps(tables)
    remap.load(fused(dict(maps), ["p", "q"]))
    assert remap.all_hashed_alike
    owned = {name: m[0][m[0] != ZCH_EMPTY_SLOT][:5] for name, m in maps.items()}
    unseen = torch.randint(-(2**63), MCH_FREE_SLOT, (5,), generator=generator)
    ids = torch.cat([owned["p"], unseen, owned["q"], unseen])
    slots = remap(ids, torch.tensor([10, 10]))
    for name, got in zip(("p", "q"), slots.split(10)):
        (identities,) = maps[name]
        assert torch.equal(identities[got[:5]], owned[name]), name
    assert (slots[5:10] >= 0).all() and torch.equal(slots[15:], torch.full((5,), -1))
    assert remap.counts.tolist() == [[5, 5], [10, 10]]


def test_the_served_maps_are_views_of_the_fused_tensors_and_maps_not_laid_end_to_end_are_refused():
    generator = torch.Generator().manual_seed(1)
    maps = {t.name: random_slot_map(t, generator) for t in TABLES}
    laid = fused(dict(maps), [t.name for t in TABLES])
    sorted_ids, slots = spanned([laid["a"], laid["b"], laid["c"], laid["d"], laid["e"]])
    assert sorted_ids.numel() == 1000 + 7 + 1 + 2 + 1500 and sorted_ids.data_ptr() == laid["a"][0].data_ptr()
    remap = RawIdRemaps(TABLES)
    remap.load(laid)
    served = remap.table_maps()
    assert all(torch.equal(a, b) for t in maps for a, b in zip(served[t], maps[t]))
    served["b"][0][0] = -5  # a delta's write through a table's view reaches the served tensor
    assert int(remap.sorted_ids[1000]) == -5
    apart = r"the slot maps of tables \['a', 'b', 'c', 'd', 'e'\] do not lie end to end"
    with pytest.raises(ValueError, match=apart):
        RawIdRemaps(TABLES).load(maps)
    split_wrong = fused({**maps, "a": tuple(p[:999] for p in maps["a"]), "b": tuple(torch.cat([p, p[:1]]) for p in maps["b"])},
                        [t.name for t in TABLES])  # the right total, the wrong tables' sizes
    with pytest.raises(ValueError, match=r"table a's slot map must be int64 \[1000\] a part, got \[\[999\], \[999\]\]"):
        RawIdRemaps(TABLES).load(split_wrong)


def test_a_bucket_index_made_before_a_delta_moved_the_owners_leaves_every_slot_right_until_made_again():
    """Evictions and insertions shift an MCH table's sorted ids in place (as a delta writes them)
    while the remap's bucket index still gives the old windows: every id gets the slot the new
    map gives, owned or not; ``refresh`` makes it give the new windows, with the same answers."""
    tables = [t for t in TABLES if t.name in ("a", "e")]
    generator = torch.Generator().manual_seed(3)
    remap = RawIdRemaps(tables)
    remap.load(fused({t.name: random_slot_map(t, generator) for t in tables}, ["a", "e"]))
    holder = torch.nn.Module()
    holder.raw_id_remaps = remap  # as a served model holds it
    for table, moved in (("a", 60), ("e", 400)):  # e's every window shifts
        served = remap.table_maps()[table]
        slots = torch.randperm(len(served[0]) - 1, generator=generator)[:moved]
        owners = torch.randint(-(2**63), MCH_FREE_SLOT, (moved,), generator=generator)
        for part, new in zip(served, with_owners(owners_of(served), slots, owners, hashed=False)):
            part.copy_(new)
    maps = remap.table_maps()
    lengths, ids, expected = [], [], []
    for table in tables:
        owned = maps[table.name][0][:-1]
        drawn = torch.cat([owned, torch.randint(-(2**63), MCH_FREE_SLOT, (500,), generator=generator)])
        ids.append(drawn)
        lengths.append(len(drawn))
        expected.append(_table_search(table, maps[table.name], drawn)[0])
    feature = torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(lengths))
    rows = torch.tensor([t.rows for t in tables])[feature]
    for refreshed in (False, True):
        assert torch.equal(remap(torch.cat(ids), torch.tensor(lengths)), torch.cat(expected)), refreshed
        low, high = remap.search_range(torch.cat(ids), feature)
        whole = int((high - low == rows - 1).sum())  # ids whose window did not hold
        assert 0 < whole < len(low) if not refreshed else whole == 0, whole
        assert refresh(holder.named_buffers()) == 1
    assert torch.equal(remap.bucket_index, index_of(remap.sorted_ids, remap.bucket_tables))
