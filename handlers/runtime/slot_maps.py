"""Slot maps: which raw id owns each slot (row) of a raw-id table, in the form the served remap
searches (``handlers.modeling.remaps``), and how a delta's new owners make a new one.

A table's slot owners are int64 [rows], row-aligned, ``MCH_FREE_SLOT`` where no id owns the slot.
An MCH table's slot map is the owners sorted (free slots last) and the slot of each; a ZCH table's
is the owners as they are, row-aligned (its hash probing finds them), ``ZCH_EMPTY_SLOT`` where free:

    owners = torch.tensor([30, FREE, -7, 12])
    sorted_ids, slots = slot_map(owners)       # [-7, 12, 30, FREE], [2, 3, 0, 1]
    (identities,) = hash_map(owners)           # [30, -1, -7, 12]
    owners_of((sorted_ids, slots))             # owners again; owners_of((identities,)) too
    with_owners(owners_of(m), torch.tensor([0]), torch.tensor([99]), hashed=False)   # slot 0: 99's

Served weights files (``weights.pt``, a compiled package's weights) hold a map's tensors under
``slot_maps.<table>.<part>``: parts ``sorted_ids`` and ``slots`` (MCH), or ``identities`` (ZCH).
The served remap searches all tables of a kind at once (``handlers.modeling.remaps``), so their
maps lie end to end, each table's a view of one tensor per part (``fused``), which a file stores
once and a worker maps once; ``spanned`` gives that tensor back:

    maps = fused({"a": (ids_a, slots_a), "b": (ids_b, slots_b)}, ["a", "b"])   # in place
    sorted_ids, slots = spanned([maps["a"], maps["b"]])    # [rows_a + rows_b] each, no copy
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import torch

from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT

# MCH: (sorted_ids int64 [rows], slots int64 [rows]), slot s's owner is sorted_ids[slots == s];
# ZCH: (identities int64 [rows],), slot s's owner is identities[s]
SlotMap = tuple[torch.Tensor, ...]
SORTED_PARTS = ("sorted_ids", "slots")
HASHED_PARTS = ("identities",)

_MAP_KEY = re.compile(r"^slot_maps\.(?P<table>[^.]+)\.(?P<part>sorted_ids|slots|identities)$")


def part_names(slot_map: SlotMap) -> tuple[str, ...]:
    """The names of a slot map's tensors, in order."""
    return HASHED_PARTS if is_hashed(slot_map) else SORTED_PARTS


def is_hashed(slot_map: SlotMap) -> bool:
    """Whether a slot map is a ZCH table's (row-aligned identities) rather than an MCH one's."""
    return len(slot_map) == len(HASHED_PARTS)


def fused(maps: dict[str, SlotMap], order: Sequence[str]) -> dict[str, SlotMap]:
    """Lays the maps of the tables named in ``order`` end to end, in that order, one tensor per
    kind and part, in place: each of those entries of ``maps`` becomes a view of them (the
    table's own tensors are let go as it is copied: a build holds one copy). Returns ``maps``."""
    for hashed in (False, True):
        names = [t for t in order if is_hashed(maps[t]) == hashed]
        if not names:
            continue
        parts = [torch.empty(sum(len(maps[t][0]) for t in names), dtype=torch.int64) for _ in maps[names[0]]]
        start = 0
        for t in names:
            rows = len(maps[t][0])
            for part, table_part in zip(parts, maps[t]):
                part[start : start + rows] = table_part
            maps[t] = tuple(part[start : start + rows] for part in parts)
            start += rows
    return maps


def spanned(maps: Sequence[SlotMap]) -> SlotMap | None:
    """The tensors (one per part) that ``maps``, one kind's, are consecutive views of, in order:
    a view over them all, no copy; None when they are not laid out so (``fused``)."""
    whole = []
    for i, first in enumerate(maps[0]):
        end = first.storage_offset()
        for part in (m[i] for m in maps):
            same = part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            if not (same and part.dtype == first.dtype and part.storage_offset() == end and part.is_contiguous()):
                return None
            end += part.numel()
        whole.append(first.as_strided((end - first.storage_offset(),), (1,), first.storage_offset()))
    return tuple(whole)


def slot_map(owners: torch.Tensor) -> SlotMap:
    """Slot owners (int64 [rows], row-aligned) as an MCH slot map; equal owners (free slots) in
    slot order."""
    order = torch.argsort(owners, stable=True)
    return owners[order], order


def hash_map(owners: torch.Tensor) -> SlotMap:
    """Slot owners (int64 [rows], row-aligned) as a ZCH slot map: its identities."""
    return (torch.where(owners == MCH_FREE_SLOT, ZCH_EMPTY_SLOT, owners),)


def owners_of(slot_map: SlotMap) -> torch.Tensor:
    """A slot map's owners, int64 [rows], row-aligned."""
    if is_hashed(slot_map):
        (identities,) = slot_map
        return torch.where(identities == ZCH_EMPTY_SLOT, MCH_FREE_SLOT, identities)
    sorted_ids, slots = slot_map
    owners = torch.empty_like(sorted_ids)
    owners[slots] = sorted_ids
    return owners


def with_owners(owners_now: torch.Tensor, slots: torch.Tensor, owners: torch.Tensor, hashed: bool) -> SlotMap:
    """The slot map (ZCH's where ``hashed``, else MCH's) after ``slots`` (int64 [n]) of a table
    whose slot owners are ``owners_now`` (int64 [rows]; changed in place) change owner to
    ``owners`` (int64 [n]; ``MCH_FREE_SLOT``: freed). Raises ``ValueError`` when an id would own
    two slots."""
    owners_now[slots] = owners
    sorted_ids, order = slot_map(owners_now)
    twice = torch.nonzero((sorted_ids[1:] == sorted_ids[:-1]) & (sorted_ids[1:] != MCH_FREE_SLOT)).flatten()
    if len(twice):
        raw_id = int(sorted_ids[twice[0]])
        held = order[sorted_ids == raw_id].tolist()
        raise ValueError(f"raw id {raw_id} would own slots {held}: an id owns one slot")
    return hash_map(owners_now) if hashed else (sorted_ids, order)


def slot_maps_in(weights: Mapping[str, torch.Tensor]) -> dict[str, SlotMap]:
    """The slot maps among a loaded served weights file's tensors, by table."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _MAP_KEY.search(key)
        if match:
            parts.setdefault(match["table"], {})[match["part"]] = tensor
    incomplete = sorted(t for t, p in parts.items() if set(p) not in (set(SORTED_PARTS), set(HASHED_PARTS)))
    if incomplete:
        raise ValueError(f"the slot maps of tables {incomplete} hold neither sorted_ids and slots nor identities alone")
    return {
        table: tuple(p[name] for name in (HASHED_PARTS if len(p) == 1 else SORTED_PARTS)) for table, p in parts.items()
    }
