"""Counting raw ids the model has not seen (``HandlerUnseenIds{Table}``, beside
``HandlerRawIds{Table}``, every id of the table looked up).

A raw-id table (``Feature.raw_id_table``) gives each raw id that owns a slot its row; any other id
looks up the table's default row (MCH: its last) or the slot its probing starts at (ZCH). The
model's own remap counts both as it maps the ids, inside the graph: each raw-id collection's
``raw_id_remaps.counts`` (``inputs.RAW_ID_COUNTER``: an eager model's buffer, a graph's constant,
a split model's lookups'), a column per raw-id table of the model, sorted by name. The counter
reads them after each batch and answers what they grew by.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from handlers.runtime.artifacts import Runner, served_tensors
from handlers.runtime.inputs import RAW_ID_COUNTER, InputSchema


class UnseenIdCounter:
    def __init__(self, tables: list[str], counts: list[torch.Tensor]) -> None:
        """``counts``: the model's running counts, int64 [2, len(tables)] each (unseen, looked
        up), a column per table of ``tables``; counted from their values now."""
        self.tables = tables
        self._counts = counts
        self._last = self._now()  # a graph's hold what its capture ran

    @classmethod
    def of_runner(cls, schema: InputSchema, runner: Runner) -> "UnseenIdCounter | None":
        """The counter of a loaded model's raw-id tables (None when it has none)."""
        features = schema.features + schema.context_sparse
        tables = sorted({f.raw_id_table for f in features if f.raw_id_table is not None})
        if not tables:
            return None
        counts = [tensor for name, tensor in served_tensors(runner) if RAW_ID_COUNTER.search(name)]
        if not counts or any(c.shape != (2, len(tables)) for c in counts):
            raise ValueError(f"raw-id tables {tables}: the loaded model does not count their ids in "
                             f"raw_id_remaps.counts [2, {len(tables)}] (found {[list(c.shape) for c in counts]}): "
                             "an archive built by an older torchrec-serve; rebuild it")
        return cls(tables, counts)

    def _now(self) -> list[list[int]]:
        total = self._counts[0] if len(self._counts) == 1 else torch.stack(self._counts).sum(0)
        return total.tolist()

    @contextlib.contextmanager
    def uncounted(self, unless_it_raises: bool = False) -> Iterator[None]:
        """What the model counts within this block is left out of ``since_last``; with
        ``unless_it_raises``, only if the block raises (a failed forward's ids are counted again
        when its requests are scored apart)."""
        before = self._now()
        try:
            yield
        except BaseException:
            self._leave_out(before)
            raise
        if not unless_it_raises:
            self._leave_out(before)

    def _leave_out(self, before: list[list[int]]) -> None:
        after = self._now()
        self._last = [[last + a - b for last, a, b in zip(*rows)] for rows in zip(self._last, after, before)]

    def since_last(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per raw-id table, the ids the model found no owner for since the last call, and all
        the ids it mapped."""
        now = self._now()
        unseen, lookups = ([a - b for a, b in zip(*rows)] for rows in zip(now, self._last))
        self._last = now
        return dict(zip(self.tables, unseen)), dict(zip(self.tables, lookups))
