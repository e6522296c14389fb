"""What the planner can choose for one table, what each choice costs in bytes, and which rows a
pruned table drops.

A ``Choice`` is a served dtype and a share of rows pruned (the least used ones). Bytes are as
served: FBGEMM's row size for the dtype (alignment included) times the rows kept, plus, for a
pruned table, its index remapping (an int32 per id, once per feature of the table). Not counted:
the pruned-id counter's flags, 1 byte per id of a pruned table in each worker of the model.

Which rows are least used comes from ``Usage``: id counts the user gives (a file of
``{table: int64 [rows]}``, e.g. from training), or counts of the ids in part of the data.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from archive_tools.validation_data import ValidationDataError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.spec import ModelSpec, Pooling, TableSpec, WeightDtype

PRUNE_SHARES = (0.5, 0.75, 0.9, 0.95, 0.99)  # shares of a table's rows a plan may prune
REMAP_BYTES = 4  # FBGEMM's index remapping: an int32 per id, per feature of the pruned table
_WIDTH = {dtype: i for i, dtype in enumerate(WeightDtype)}  # 0: the widest


@dataclasses.dataclass(frozen=True)
class Choice:
    dtype: WeightDtype
    pruned_share: float = 0.0

    @property
    def label(self) -> str:
        return self.dtype.value + (f", {self.pruned_share:.0%} of rows pruned" if self.pruned_share else "")

    def beyond(self, other: "Choice") -> bool:
        """At least as far from full precision as ``other`` in both respects (narrower or equal
        dtype, at least as many rows pruned)."""
        return _WIDTH[self.dtype] >= _WIDTH[other.dtype] and self.pruned_share >= other.pruned_share


def options(spec: ModelSpec, table: TableSpec, prune: bool, widest: WeightDtype = WeightDtype.FP32) -> list[Choice]:
    """Every choice for ``table``: each dtype it can be served in up to ``widest``, each pruned
    share where it can be pruned (a pooled table of a model not sharded by TorchRec)."""
    prunable = prune and table.pooling != Pooling.NONE and not spec.is_sharded
    shares = (0.0,) + tuple(s for s in PRUNE_SHARES if prunable and 0 < pruned_rows(table, s) < table.rows)
    dtypes = [d for d in spec.servable_dtypes(table) if _WIDTH[d] >= _WIDTH[widest]]
    return [Choice(dtype, share) for dtype in dtypes for share in shares]


def no_wider(dtype: WeightDtype, than: WeightDtype) -> bool:
    return _WIDTH[dtype] >= _WIDTH[than]


def pruned_rows(table: TableSpec, share: float) -> int:
    return math.floor(table.rows * share)


class TableBytes:
    """Bytes of each table under each choice, as served."""

    def __init__(self, spec: ModelSpec) -> None:
        self.tables = {t.name: t for t in spec.tables}
        self.row_bytes: dict[tuple[str, WeightDtype], int] = {}
        for dtype in WeightDtype:
            variant = spec.replace(tables=[in_dtype(spec, t, dtype) for t in spec.tables])
            served_as = {t.name: t.weight_dtype for t in variant.tables}
            for name, size in DLRMFactory(variant).table_bytes().items():
                self.row_bytes[(name, served_as[name])] = size // self.tables[name].rows

    def of_table(self, name: str, choice: Choice) -> int:
        table = self.tables[name]
        kept = table.rows - pruned_rows(table, choice.pruned_share)
        remap = REMAP_BYTES * table.rows * len(table.features) if choice.pruned_share else 0
        return kept * self.row_bytes[(name, choice.dtype)] + remap

    def of(self, choices: dict[str, Choice]) -> int:
        return sum(self.of_table(name, choice) for name, choice in choices.items())


class Usage:
    """Each table's ids from most to least used (ties: lower id first): a pruned share drops the
    tail. ``counts``: int64 [rows] per table (a table without counts is never pruned)."""

    def __init__(self, counts: dict[str, torch.Tensor]) -> None:
        self._order = {}
        self._rank: dict[str, torch.Tensor] = {}  # per table, each id's place in its order (int32)
        for name, count in counts.items():
            # a stable sort of -count keeps ids ascending among equal counts
            self._order[name] = torch.sort(-count.to(torch.int64), stable=True).indices

    def kept_ids(self, table: TableSpec, share: float) -> torch.Tensor:
        """The ids a table keeps with ``share`` of its rows pruned, ascending."""
        return torch.sort(self._order[table.name][: table.rows - pruned_rows(table, share)]).values

    def ranks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Each of ``ids``'s place in the table's order (0: the most used)."""
        if table not in self._rank:
            order = self._order[table]
            self._rank[table] = torch.empty(len(order), dtype=torch.int32)
            self._rank[table][order] = torch.arange(len(order), dtype=torch.int32)
        return self._rank[table][ids].long()

    def tables(self) -> set[str]:
        return set(self._order)


def read_counts(path: Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A counts file: ``{table: int64 [rows]}`` (how often training looked each id up)."""
    try:
        counts = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file, or not plain tensors
        raise ValidationDataError(f"{path}: not a counts file torch can load: {str(e).splitlines()[0]}") from None
    tables = {t.name: t for t in spec.tables}
    if not isinstance(counts, dict):
        raise ValidationDataError(f"{path}: must map table names to int64 [rows] counts")
    for name, count in counts.items():
        if name not in tables:
            raise ValidationDataError(f"{path}: {name}: not a table of {spec.name} ({', '.join(tables)})")
        if not isinstance(count, torch.Tensor) or count.shape != (tables[name].rows,) or count.is_floating_point():
            raise ValidationDataError(f"{path}: {name}: counts must be integers [{tables[name].rows}] (one per id)")
    return counts


def in_dtype(spec: ModelSpec, table: TableSpec, dtype: WeightDtype) -> TableSpec:
    """``table`` in ``dtype``, or in the narrowest dtype wider than it that the table can be served in."""
    ladder = spec.servable_dtypes(table)
    wider = [d for d in ladder if _WIDTH[d] <= _WIDTH[dtype]]
    return table.model_copy(update={"weight_dtype": wider[-1] if wider else ladder[0]})
