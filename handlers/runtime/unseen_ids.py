"""Counting raw ids the model has not seen (``HandlerUnseenIds{Table}``, beside
``HandlerRawIds{Table}``, every id of the table looked up).

A raw-id table (``Feature.raw_id_table``) gives each raw id that owns a slot its row; any other id
looks up the table's default row (MCH: its last) or the slot its probing starts at (ZCH). The
model's own remap counts both as it maps the ids,
inside the graph (``raw_id_remaps.<table>.unseen`` and ``.lookups``: an eager model's buffers, a
graph's constants, a split model's lookups'); the counter reads them after each batch, one
stack of scalars, and answers what they grew by.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from handlers.runtime.artifacts import CompiledPackage, Runner
from handlers.runtime.inputs import RAW_ID_COUNTER, InputSchema


class UnseenIdCounter:
    def __init__(self, unseen: dict[str, torch.Tensor], lookups: dict[str, torch.Tensor]) -> None:
        """``unseen`` / ``lookups``: per raw-id table, the model's running counts (0-dim int64);
        counted from their values now."""
        self.tables = sorted(unseen)
        self._counters = [unseen[t] for t in self.tables] + [lookups[t] for t in self.tables]
        self._last = torch.stack(self._counters).tolist()  # a graph's hold what its capture ran

    @classmethod
    def of_runner(cls, schema: InputSchema, runner: Runner) -> "UnseenIdCounter | None":
        """The counter of a loaded model's raw-id tables (None when it has none)."""
        tables = {f.raw_id_table for f in schema.features + schema.context_sparse} - {None}
        if not tables:
            return None
        found: dict[str, dict[str, torch.Tensor]] = {"unseen": {}, "lookups": {}}
        for name, tensor in _named_tensors(runner):
            match = RAW_ID_COUNTER.search(name)
            if match:
                found[match["counter"]][match["table"]] = tensor
        missing = sorted(tables - set(found["unseen"]) - set(found["lookups"]))
        if missing or set(found["unseen"]) != set(found["lookups"]):
            raise ValueError(f"raw-id tables {missing or sorted(tables)}: the loaded model does not count their ids")
        return cls(found["unseen"], found["lookups"])

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """What the model counts within this block is left out of ``since_last``."""
        before = torch.stack(self._counters).tolist()
        yield
        after = torch.stack(self._counters).tolist()
        self._last = [last + a - b for last, a, b in zip(self._last, after, before)]

    def since_last(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per raw-id table, the ids the model found no owner for since the last call, and all
        the ids it mapped."""
        now = torch.stack(self._counters).tolist()
        grown = [a - b for a, b in zip(now, self._last)]
        self._last = now
        n = len(self.tables)
        return dict(zip(self.tables, grown[:n])), dict(zip(self.tables, grown[n:]))


def _named_tensors(runner: Runner) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a loaded model holds, by name: a split model's lookups', a graph's constants
    or buffers, an eager model's buffers."""
    part = getattr(runner, "sparse", runner)
    run = getattr(part, "run", None)
    if isinstance(run, CompiledPackage):
        yield from run.active.items()
    module = run if isinstance(run, nn.Module) else getattr(part, "module", None)
    if isinstance(module, nn.Module):
        yield from module.named_buffers()
