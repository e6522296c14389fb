"""Dense weights swap whole: a delta's dense section is loaded into an inactive copy, which then
replaces the served weights between forwards, in each worker on its own (dense weights are private
to a worker; only the tables are shared).

A runner that can swap implements ``DenseSlot``: an AOTInductor package (its inactive constant
buffer, ``CompiledPackage.swap``), an eager model (a second model around the same mapped tables,
``SwappableEagerModel``), or a split model's dense part when that is one of these. An exported
program cannot: ``dense_slot`` says why.

    slot = dense_slot(runner)                    # or a str: why this runner cannot swap
    check_dense(header.dense, slot.dense_shapes())
    slot.swap_dense(delta.dense())               # None: back to the archive's own weights
"""

from __future__ import annotations

import re
from typing import Mapping, Protocol, runtime_checkable

import torch

from handlers.runtime.freshness.delta_file import DenseShapes

# The table buffers among a compiled package's constants: the TBEs' own, never swapped.
_TABLE_CONSTANT = re.compile(r"\.tbes\.\d+\.")


@runtime_checkable
class DenseSlot(Protocol):
    def dense_shapes(self) -> DenseShapes | str:
        """What a dense section must give (every dense tensor), or why this runner cannot swap."""

    def swap_dense(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Serves ``tensors`` from the next forward on (None: the archive's own weights)."""


def dense_slot(runner: object) -> DenseSlot | str:
    """The part of ``runner`` whose dense weights swap, or why there is none."""
    part = getattr(runner, "dense", runner)  # a split model's dense part
    if not isinstance(part, DenseSlot):
        return f"{type(part).__name__} cannot swap its dense weights"
    shapes = part.dense_shapes()
    return shapes if isinstance(shapes, str) else part


def is_table_constant(name: str) -> bool:
    return _TABLE_CONSTANT.search(name) is not None
