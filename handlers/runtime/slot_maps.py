"""Slot maps: which raw id owns each slot (row) of a raw-id table, in the form the served remap
searches (``handlers.modeling.raw_ids.SlotRemap``), and how a delta's new owners make a new one.

A table's slot owners are int64 [rows], row-aligned, ``MCH_FREE_SLOT`` where no id owns the slot.
Its slot map is the owners sorted (free slots last) and the slot of each:

    owners = torch.tensor([30, FREE, -7, 12])
    sorted_ids, slots = slot_map(owners)       # [-7, 12, 30, FREE], [2, 3, 0, 1]
    owners_of((sorted_ids, slots))             # owners again
    with_owners(owners_of((sorted_ids, slots)), torch.tensor([0]), torch.tensor([99]))   # slot 0: 99's

Served weights files hold a map's two tensors under ``slot_maps.<table>.sorted_ids`` / ``.slots``
(``weights.pt``) or as a compiled graph's constants ``<module path>.raw_id_remaps.<table>.*``.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from handlers.runtime.inputs import MCH_FREE_SLOT, SLOT_MAPS

# (sorted_ids int64 [rows], slots int64 [rows]): slot s's owner is sorted_ids[slots == s]
SlotMap = tuple[torch.Tensor, torch.Tensor]

_MAP_KEY = re.compile(rf"(?:^slot_maps|\.{SLOT_MAPS})\.(?P<table>[^.]+)\.(?P<part>sorted_ids|slots)$")


def slot_map(owners: torch.Tensor) -> SlotMap:
    """Slot owners (int64 [rows], row-aligned) as a slot map; equal owners (free slots) in slot
    order."""
    order = torch.argsort(owners, stable=True)
    return owners[order], order


def owners_of(slot_map: SlotMap) -> torch.Tensor:
    """A slot map's owners, int64 [rows], row-aligned."""
    sorted_ids, slots = slot_map
    owners = torch.empty_like(sorted_ids)
    owners[slots] = sorted_ids
    return owners


def with_owners(owners_now: torch.Tensor, slots: torch.Tensor, owners: torch.Tensor) -> SlotMap:
    """The slot map after ``slots`` (int64 [n]) of a table whose slot owners are ``owners_now``
    (int64 [rows]; changed in place) change owner to ``owners`` (int64 [n]; ``MCH_FREE_SLOT``:
    freed). Raises ``ValueError`` when an id would own two slots."""
    owners_now[slots] = owners
    sorted_ids, order = slot_map(owners_now)
    twice = torch.nonzero((sorted_ids[1:] == sorted_ids[:-1]) & (sorted_ids[1:] != MCH_FREE_SLOT)).flatten()
    if len(twice):
        raw_id = int(sorted_ids[twice[0]])
        held = order[sorted_ids == raw_id].tolist()
        raise ValueError(f"raw id {raw_id} would own slots {held}: an id owns one slot")
    return sorted_ids, order


def slot_maps_in(weights: Mapping[str, torch.Tensor]) -> dict[str, SlotMap]:
    """The slot maps among a loaded served weights file's tensors, by table."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _MAP_KEY.search(key)
        if match:
            parts.setdefault(match["table"], {})[match["part"]] = tensor
    incomplete = sorted(t for t, p in parts.items() if len(p) != 2)
    if incomplete:
        raise ValueError(f"the slot maps of tables {incomplete} lack sorted_ids or slots")
    return {table: (p["sorted_ids"], p["slots"]) for table, p in parts.items()}
