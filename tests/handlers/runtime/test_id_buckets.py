"""The MCH bucket index (``handlers.runtime.id_buckets``): each bucket's start among a table's
sorted owners, checked against the owners' buckets computed with Python's exact integers, for
owners spread over the int64 range, clustered in value, near its ends, partly free, and tables of
one and two slots; and a remap whose buckets fill unevenly still gives TorchRec's slots."""

from __future__ import annotations

import torch

from handlers.modeling.remaps import RawIdRemaps
from handlers.modeling.spec import TableSpec
from handlers.runtime.id_buckets import HEADER, OCCUPANCY, bucket_count, bucket_tables, index_of
from handlers.runtime.inputs import MCH_FREE_SLOT
from handlers.runtime.slot_maps import fused, slot_map

INT64_MIN = -(2**63)


def _owners(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Each table's owners, row-aligned (``MCH_FREE_SLOT``: a free slot; the last slot always)."""
    def table(ids: list[int] | torch.Tensor, rows: int) -> torch.Tensor:
        owners = torch.full((rows,), MCH_FREE_SLOT, dtype=torch.int64)
        owners[: len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
        return owners[torch.randperm(rows - 1, generator=generator).tolist() + [rows - 1]]

    spread = torch.randint(INT64_MIN, MCH_FREE_SLOT, (999,), generator=generator).unique()
    return {
        "spread": table(spread, len(spread) + 1),
        "clustered": table(list(range(500)) + [2**62, -(2**62)], 503),  # one bucket holds nearly all
        "ends": table([INT64_MIN, INT64_MIN + 1, MCH_FREE_SLOT - 1, MCH_FREE_SLOT - 2, 0], 6),
        "partly_free": table(list(range(-300, 300, 7)), 400),
        "one": table([], 1),
        "two": table([-5], 2),
        "none_owned": table([], 40),
    }


def test_each_bucket_starts_at_its_first_owner_and_the_shift_is_the_least_that_fits_the_owners():
    owners = _owners(torch.Generator().manual_seed(0))
    sorted_ids = torch.cat([slot_map(o)[0] for o in owners.values()])  # the tables end to end
    firsts = [sum(len(o) for o in list(owners.values())[:i]) for i in range(len(owners))]
    tables = bucket_tables(firsts, [len(o) for o in owners.values()])
    index = index_of(sorted_ids, tables)
    assert len(index) == sum(bucket_count(len(o)) + HEADER + 1 for o in owners.values())
    for name, (first, rows, offset, buckets) in zip(owners, tables.tolist()):
        assert buckets == max(2, -(-(rows - 1) // OCCUPANCY)), name
        shift, base = index[offset : offset + HEADER].tolist()
        starts = index[offset + HEADER : offset + HEADER + buckets + 1].tolist()
        searched = sorted_ids[first : first + rows - 1].tolist()  # the last slot has no owner
        owned = [x for x in searched if x != MCH_FREE_SLOT]
        of = [(x >> shift) - base for x in owned]  # Python's >> floors, as an arithmetic shift does
        assert all(0 <= b < buckets for b in of), name
        if shift and owned:  # one less would not fit
            assert (max(owned) >> (shift - 1)) - (min(owned) >> (shift - 1)) >= buckets, name
        # each bucket's start: the first owner whose bucket is not below it (free slots sort last)
        every = [(x >> shift) - base for x in searched]
        assert starts == [next((p for p, x in enumerate(every) if x >= b), rows - 1) for b in range(buckets + 1)], name


def test_a_remap_whose_buckets_fill_unevenly_gives_every_id_its_tables_slot():
    """Owners clustered in value put nearly all of a table's owners in one bucket and leave the
    rest empty: the windows differ in width by hundreds, and every id still gets the slot
    ``torch.searchsorted`` over the table gives (or the default slot); a batch of no ids maps
    to none."""
    generator = torch.Generator().manual_seed(1)
    owners = _owners(generator)
    tables = [TableSpec(name=name, rows=len(o), dim=4, features=[f"f_{name}"], ids="raw", remap={"kind": "mch"})
              for name, o in owners.items()]
    maps = {name: slot_map(o) for name, o in owners.items()}
    remap = RawIdRemaps(tables)
    remap.load(fused(dict(maps), list(owners)))
    ids, lengths, expected = [], [], []
    for name, (sorted_ids, slots) in maps.items():
        drawn = torch.cat([sorted_ids[:-1][sorted_ids[:-1] != MCH_FREE_SLOT], torch.arange(-40, 40),
                           torch.tensor([INT64_MIN, MCH_FREE_SLOT - 1, 2**62 + 1, -(2**62) - 1]),
                           torch.randint(INT64_MIN, MCH_FREE_SLOT, (50,), generator=generator)])
        found = torch.searchsorted(sorted_ids[:-1], drawn)
        expected.append(torch.where(sorted_ids[found] == drawn, slots[found], len(sorted_ids) - 1))
        ids.append(drawn)
        lengths.append(len(drawn))
    assert torch.equal(remap(torch.cat(ids), torch.tensor(lengths)), torch.cat(expected))
    feature = torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(lengths))
    low, high = remap.search_range(torch.cat(ids), feature)
    assert int((high - low).max()) >= 400  # the clustered table's one full bucket
    counted = remap.counts.clone()
    none = remap(torch.empty(0, dtype=torch.int64), torch.zeros(len(tables), dtype=torch.int64))
    assert none.shape == (0,) and torch.equal(remap.counts, counted)  # a batch of no ids: no window to halve
