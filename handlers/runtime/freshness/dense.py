"""Dense weights swap whole: a delta's dense section is loaded as a new set of weights, which then
replaces the served ones between forwards, in each worker on its own (dense weights are private to
a worker; only the tables are shared).

A runner that can swap implements ``DenseSlot``: an AOTInductor package (its constants handed
over whole between two runs, ``CompiledPackage.swap``), an eager model (a second model around the same mapped tables,
``SwappableEagerModel``), or a split model's dense part when that is one of these. An exported
program cannot: ``dense_slot`` says why.

    slot = dense_slot(runner)                    # or a str: why this runner cannot swap
    check_dense(header.dense, slot.dense_shapes())
    slot.swap_dense(delta.dense())               # None: back to the archive's own weights
    DenseFollower(slot, layout, folder).sync(log) # what the applied tables go with, once per worker
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Mapping, Protocol, runtime_checkable

import torch

from handlers.runtime.freshness.applier import AppliedState
from handlers.runtime.freshness.delta_file import DenseShapes, read_delta, read_header
from handlers.runtime.freshness.layout import TablesLayout
from handlers.runtime.inputs import is_slot_map
from handlers.runtime.freshness.log import log_entries

logger = logging.getLogger(__name__)

# The TBEs' buffers among a compiled package's constants: table state, never swapped with the
# dense weights (nor are raw-id tables' slot maps and counters: inputs.is_slot_map).
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
    return _TABLE_CONSTANT.search(name) is not None or is_slot_map(name)


class DenseFollower:
    """Keeps one worker serving the dense weights that go with the applied tables: those of the
    newest applied delta that has a dense section, or the archive's own."""

    def __init__(self, slot: DenseSlot, layout: TablesLayout, folder: Path) -> None:
        self.slot = slot
        self.layout = layout
        self.folder = folder  # the working copy's state: the applied sequence
        self.sequence = 0  # the delta whose dense weights this worker serves (0: the archive's)
        self.swap_s: float | None = None
        self._file: tuple[int, int] | None = None  # that delta's file (a rolled-back one may be replaced)
        self._has_dense: dict[tuple[int, int], bool] = {}  # the log's deltas (by file): which have dense weights

    def sync(self, log: Path) -> bool:
        """Swaps in the weights this worker should serve; whether it swapped."""
        applied = AppliedState.read(self.folder).sequence
        entries = log_entries(log)
        wanted = max((s for s, path in entries.items() if s <= applied and self._dense_in(path)), default=0)
        source = _identity(entries[wanted]) if wanted else None
        if source == self._file:
            return False
        started = time.perf_counter()
        self.slot.swap_dense(read_delta(entries[wanted], self.layout).dense() if wanted else None)
        self.swap_s = time.perf_counter() - started
        self.sequence, self._file = wanted, source
        logger.info("serving the dense weights of delta %d (swapped in %.3fs)", wanted, self.swap_s)
        return True

    def _dense_in(self, path: Path) -> bool:
        key = _identity(path)
        if key not in self._has_dense:
            self._has_dense[key] = read_header(path).dense is not None
        return self._has_dense[key]


def _identity(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_ino, status.st_mtime_ns
