"""Counting the ids of pruned tables that have no row (``HandlerPrunedIds{Table}``).

A pruned table (``Feature.pruned_table``) serves the rows of the ids its archive's ``pruning.pt``
keeps; any other id looks up a zero row. The counter holds, per pruned table, one flag per id
(1 byte per id: 40 MB for a 40M-id table) and counts a forward's pruned ids with one gather per
pruned feature.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch

from handlers.runtime.archive_files import PRUNING
from handlers.runtime.inputs import InputSchema, JaggedIds, RequestInputs


class PrunedIdCounter:
    def __init__(self, schema: InputSchema, kept: dict[str, torch.Tensor]) -> None:
        self._pruned: dict[str, torch.Tensor] = {}  # table -> bool [rows]: True where an id has no row
        self._tables: list[tuple[str, str, str]] = []  # (input, feature, table) to count, in order
        for tag, features in ((schema.jagged, schema.features), (schema.context_jagged, schema.context_sparse)):
            for feature in features:
                table = feature.pruned_table
                if tag is None or table is None:
                    continue
                if table not in self._pruned:
                    flags = torch.ones(feature.rows, dtype=torch.bool)
                    flags[kept[table]] = False
                    self._pruned[table] = flags
                self._tables.append((tag.name, feature.name, table))
        self._keys = {tag.name: tag.keys for tag in schema.tags}

    @classmethod
    def of_archive(cls, model_dir: Path, schema: InputSchema) -> "PrunedIdCounter | None":
        """The counter for an archive's pruned tables (None when it has none); an archive without
        its kept-ids file is refused naming it."""
        tables = sorted({f.pruned_table for f in schema.features + schema.context_sparse if f.pruned_table})
        if not tables:
            return None
        path = model_dir / PRUNING
        if not path.is_file():
            raise FileNotFoundError(
                f"{model_dir}: holds no {PRUNING}, the kept ids of its pruned tables ({', '.join(tables)}): build it again"
            )
        return cls(schema, torch.load(path, map_location="cpu", weights_only=True))

    def count(self, inputs: RequestInputs) -> collections.Counter[str]:
        """Per pruned table, the ids of ``inputs`` that look up a zero row."""
        counts: collections.Counter[str] = collections.Counter()
        segments: dict[str, dict[str, torch.Tensor]] = {}
        for name, feature, table in self._tables:
            if name not in segments:
                ids: JaggedIds = inputs.tensors[name]  # type: ignore[assignment]
                segments[name] = dict(zip(self._keys[name], ids.per_feature()))
            counts[table] += int(self._pruned[table][segments[name][feature]].sum())
        return counts
