"""The MCH search's bucket index: for each raw-id table, where each bucket of raw-id values starts
among its sorted owners. The served remap (``handlers.modeling.remaps``) reads an id's bucket
from it, then halves that bucket's window of about ``OCCUPANCY`` owners.

A bucket holds the ids that share their top bits: id ``x`` falls in bucket ``(x >> shift) -
base`` (clamped to the table's ``buckets``), where ``shift`` is the least that spreads the table's
owners over at most its ``buckets`` (``bucket_count``: one per ``OCCUPANCY`` slots). Ids spread
over the int64 range fill the buckets alike. Ids clustered in value fill some more than others,
which costs those windows halvings, never exactness.

The index is derived data, each worker's own (8 bytes a bucket: 89 MB at the Criteo 1TB size),
never stored. It is made at load (``index_of``; a compiled package's constant: ``derived_constants``)
and made again after deltas move the owners (``refresh``). An index older than the owners costs
speed, not exactness: the remap keeps a window only where the owners on either side confirm it
holds the id's place, and searches the whole table otherwise. So an index may be made again
while forwards read it.

    tables = bucket_tables(first_slots, rows)   # int64 [tables, 4]: first slot, rows, offset, buckets
    index = index_of(sorted_ids, tables)        # int64 [sum(buckets + 3)]: per table shift, base, starts
    refresh(served_tensors(runner))             # after a delta: every index made again from its owners
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

import torch

from handlers.runtime.inputs import MCH_FREE_SLOT, SLOT_MAPS

OCCUPANCY = 16  # owners a bucket, on average
HEADER = 2  # a table's index begins with its shift and base, then its buckets' starts
FIRST, ROWS, OFFSET, BUCKETS = range(4)  # the columns of ``bucket_tables``
# A raw-id collection's bucket index, by its name in a model or package; its owners and tables beside it.
_INDEX = re.compile(rf"(?P<remap>(?:^|.*\.){SLOT_MAPS})\.bucket_index$")


def bucket_count(rows: int) -> int:
    """How many buckets a table of ``rows`` slots gets: at least two (a shift of 63 leaves two)."""
    return max(2, -(-(rows - 1) // OCCUPANCY))


def bucket_tables(first_slots: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
    """Each table's first slot and rows in the collection's sorted ids -> int64 [tables, 4]: those,
    then where its index begins and how many buckets it has."""
    buckets = [bucket_count(r) for r in rows]
    offsets = [sum(b + HEADER + 1 for b in buckets[:i]) for i in range(len(buckets))]
    return torch.tensor(list(zip(first_slots, rows, offsets, buckets)), dtype=torch.int64).reshape(-1, 4)


def index_size(tables: torch.Tensor) -> int:
    return int((tables[:, BUCKETS] + HEADER + 1).sum())


def index_of(sorted_ids: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Sorted ids int64 [n] of ``tables`` (``bucket_tables``) -> their index, int64
    [``index_size``]: per table its shift, its base, then for each bucket ``b`` (and one past the
    last) the first of its owners, counted from its first slot, whose bucket is not below ``b``."""
    index = torch.empty(index_size(tables), dtype=torch.int64)
    for first, rows, offset, buckets in tables.tolist():
        owners = sorted_ids[first : first + rows - 1]  # the last slot is the default row's: no owner
        owned = int(torch.searchsorted(owners, MCH_FREE_SLOT))  # free slots sort last
        low, high = (int(owners[0]), int(owners[owned - 1])) if owned else (0, 0)
        shift = next(s for s in range(64) if (high >> s) - (low >> s) < buckets)
        base = low >> shift
        # bucket b's first id is (base + b) << shift, where that fits in int64; none is above
        top = min(buckets, (MCH_FREE_SLOT >> shift) - base)
        firsts = (torch.arange(top + 1, dtype=torch.int64) + base) << shift
        starts = torch.full((buckets + 1,), rows - 1, dtype=torch.int64)
        starts[: top + 1] = torch.searchsorted(owners, firsts)
        index[offset : offset + HEADER] = torch.tensor([shift, base])
        index[offset + HEADER : offset + HEADER + buckets + 1] = starts
    return index


def is_index(name: str) -> bool:
    return _INDEX.match(name) is not None


def derived_constants(constants: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The bucket indexes among a compiled package's constant ``names``, made from ``constants``'
    sorted ids and bucket tables (a weights file holds no index)."""
    made = {}
    for name in names:
        match = _INDEX.match(name)
        if match:
            made[name] = index_of(constants[f"{match['remap']}.sorted_ids"], constants[f"{match['remap']}.bucket_tables"])
    return made


def refresh(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Each bucket index among a served model's named tensors (``artifacts.served_tensors``) made
    again, in place, from its collection's sorted ids as they are now; returns how many."""
    named = dict(tensors)
    made = derived_constants(named, named)
    for name, index in made.items():
        named[name].copy_(index)
    return len(made)
