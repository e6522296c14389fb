"""The MCH search's fences: every ``FENCE_STRIDE``-th of a raw-id collection's sorted ids, which
the served remap searches first (``handlers.modeling.remaps``), then one block of the sorted ids.

A fence is derived data, each worker's own (kilobytes a million slots), never stored: made at load
(``fences_of``; a compiled package's constant, ``derived_constants``) and made again after deltas
move the sorted ids (``refresh_fences``). A fence older than the sorted ids costs speed, not
exactness: the remap keeps a block only where the ids around it confirm it holds the answer, and
searches the whole table otherwise. So a fence may be refreshed while forwards read it.

    fences = fences_of(sorted_ids)             # int64 [ceil(n / 256) + 1]
    refresh_fences(served_tensors(runner))     # after a delta: each fence from its sorted ids again
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch

from handlers.runtime.inputs import MCH_FREE_SLOT, SLOT_MAPS

FENCE_STRIDE = 256
# A raw-id collection's sorted ids and its fences, by their names in a model or package.
_SORTED_IDS = re.compile(rf"(?P<remap>(?:^|.*\.){SLOT_MAPS})\.sorted_ids$")
_FENCES = re.compile(rf"(?:^|\.){SLOT_MAPS}\.fences$")


def fences_of(sorted_ids: torch.Tensor) -> torch.Tensor:
    """Sorted ids int64 [n] -> their fences, int64 [ceil(n / FENCE_STRIDE) + 1]: entry k is
    ``sorted_ids[k * FENCE_STRIDE]``, the last ``MCH_FREE_SLOT`` (a search's upper end reads it)."""
    return torch.cat([sorted_ids[::FENCE_STRIDE], torch.tensor([MCH_FREE_SLOT])])


def is_fences(name: str) -> bool:
    return _FENCES.search(name) is not None


def derived_constants(constants: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The fences among a compiled package's constant ``names``, made from ``constants``' sorted
    ids (a weights file holds none)."""
    fences = {}
    for name in names:
        if is_fences(name):
            fences[name] = fences_of(constants[name.removesuffix("fences") + "sorted_ids"])
    return fences


def refresh_fences(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Each fence among a served model's named tensors (``artifacts.served_tensors``) made again,
    in place, from its collection's sorted ids as they are now; returns how many."""
    named = dict(tensors)
    refreshed = 0
    for name, sorted_ids in named.items():
        match = _SORTED_IDS.match(name)
        fences = named.get(f"{match['remap']}.fences") if match else None
        if fences is not None:
            fences[:-1].copy_(sorted_ids[::FENCE_STRIDE])
            refreshed += 1
    return refreshed
