"""Counting raw ids the model has not seen (``HandlerUnseenIds{Table}``, beside
``HandlerRawIds{Table}``, every id of the table looked up).

A raw-id table (``Feature.raw_id_table``) gives each raw id that owns a slot its row; any other id
looks up the table's default row (its last). The counter reads which ids own slots from the loaded
model's own slot maps (``raw_id_remaps.<table>.sorted_ids``: an eager model's buffers, a graph's
constants, a split model's lookups), so it costs no copy, and counts a forward's unseen ids with
one binary search per raw-id feature, as the model's remap does.
"""

from __future__ import annotations

import collections
import re
from typing import Iterator

import torch
from torch import nn

from handlers.runtime.artifacts import CompiledPackage, Runner
from handlers.runtime.inputs import SLOT_MAPS, InputSchema, JaggedIds, RequestInputs

_SLOT_MAP = re.compile(rf"(?:^|\.){SLOT_MAPS}\.(?P<table>[^.]+)\.sorted_ids$")


class UnseenIdCounter:
    def __init__(self, schema: InputSchema, sorted_ids: dict[str, torch.Tensor]) -> None:
        """``sorted_ids``: per raw-id table, the raw ids that own its slots, sorted (free slots
        last, as the int64 maximum)."""
        self._sorted = sorted_ids
        self._features: list[tuple[str, str, str]] = []  # (input, feature, table), in order
        for tag, features in ((schema.jagged, schema.features), (schema.context_jagged, schema.context_sparse)):
            for feature in features:
                if tag is not None and feature.raw_id_table is not None:
                    self._features.append((tag.name, feature.name, feature.raw_id_table))
        missing = sorted({table for *_, table in self._features} - set(sorted_ids))
        if missing:
            raise ValueError(f"raw-id tables {missing}: the loaded model holds no slot map for them")
        self._keys = {tag.name: tag.keys for tag in schema.tags}

    @classmethod
    def of_runner(cls, schema: InputSchema, runner: Runner) -> "UnseenIdCounter | None":
        """The counter for a loaded model's raw-id tables (None when it has none)."""
        if not any(f.raw_id_table for f in schema.features + schema.context_sparse):
            return None
        found = {}
        for name, tensor in _named_tensors(runner):
            match = _SLOT_MAP.search(name)
            if match:
                found[match["table"]] = tensor
        return cls(schema, found)

    def count(self, inputs: RequestInputs) -> tuple[collections.Counter[str], collections.Counter[str]]:
        """Per raw-id table, the ids of ``inputs`` that own no slot, and all its ids."""
        unseen: collections.Counter[str] = collections.Counter()
        looked_up: collections.Counter[str] = collections.Counter()
        segments: dict[str, dict[str, torch.Tensor]] = {}
        for name, feature, table in self._features:
            if name not in segments:
                ids: JaggedIds = inputs.tensors[name]  # type: ignore[assignment]
                segments[name] = dict(zip(self._keys[name], ids.per_feature()))
            values, owners = segments[name][feature], self._sorted[table]
            slot = torch.searchsorted(owners[:-1], values)
            unseen[table] += int((owners[slot] != values).sum())
            looked_up[table] += values.numel()
        return unseen, looked_up


def _named_tensors(runner: Runner) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a loaded model holds, by name: a split model's lookups', a graph's constants
    or buffers, an eager model's buffers."""
    part = getattr(runner, "sparse", runner)
    run = getattr(part, "run", None)
    if isinstance(run, CompiledPackage):
        yield from run.original.items()
    module = run if isinstance(run, nn.Module) else getattr(part, "module", None)
    if isinstance(module, nn.Module):
        yield from module.named_buffers()
