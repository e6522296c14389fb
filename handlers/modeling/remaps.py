"""The served remap of a raw-id collection: every feature's raw ids to its table's slots at once,
exactly as TorchRec's eval remaps (MCH, ZCH) map them one table at a time, and the unseen ids
counted as they go.

One search over all tables of a kind, not one per table: a graph step per table (26 of them in a
Criteo-shaped model) cost more at one item than the searches themselves. So a kind's slot maps lie
end to end (``slot_maps.fused``), each table a range of them:

* MCH: ``sorted_ids`` / ``slots``, each table's owners sorted and the slot of each. A binary search
  bounded by each id's table range finds the first owner not below the id (``torch.searchsorted``
  on that table); an id that owns no slot gets its table's last slot, the default row. The search
  reads the id's bucket in its table's bucket index first (``handlers.runtime.id_buckets``: where
  the owners of each range of ids start), then halves that bucket's window of about 16 owners: a
  few cache lines an id, where halving a 10M-slot table touches a new one at each step.
* ZCH: ``identities``, row-aligned. FBGEMM's probing (``tbe.zch_slots``) within each id's bucket,
  given as that table's range of the whole: an id that owns no slot gets its first probe slot, or,
  in a table with ``unseen: zero``, slot -1, which FBGEMM's lookup leaves out of the bag.

    remaps = RawIdRemaps(tables, counted=["t_a", "t_b"])
    remaps.load(fused(maps, [t.name for t in tables]))
    slots = remaps(ids, feature_lengths)   # int64 [V] feature-major, [F] -> int64 [V], table-local
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from handlers.modeling import tbe
from handlers.modeling.remap_spec import RemapKind, RemapSpec
from handlers.modeling.spec import TableSpec
from handlers.runtime.id_buckets import BUCKETS, FIRST, HEADER, OFFSET, ROWS, bucket_tables, index_of
from handlers.runtime.slot_maps import HASHED_PARTS, SORTED_PARTS, SlotMap, spanned


class RawIdRemaps(nn.Module):
    """Raw ids of ``tables``' features (in that order: ``features``) -> slots. ``counts`` (int64
    [2, len(counted)]): per table of ``counted`` (the model's raw-id tables; default these), the
    ids found owning no slot and all ids mapped since load (``handlers.runtime.unseen_ids``)."""

    def __init__(self, tables: Sequence[TableSpec], counted: Sequence[str] | None = None) -> None:
        super().__init__()
        counted = list(counted if counted is not None else sorted(t.name for t in tables))
        sorted_kind = [t for t in tables if t.remap and t.remap.kind == RemapKind.MCH]
        hashed = [t for t in tables if t.remap and t.remap.kind == RemapKind.ZCH]
        self.features = [f for t in tables for f in t.features]
        self.ranges = {**_ranges(sorted_kind), **_ranges(hashed)}  # table -> (first slot, rows) in its kind's maps
        self.sorted_tables, self.hashed_tables = [t.name for t in sorted_kind], [t.name for t in hashed]
        # Per feature, of its table: its column in ``counts`` (one-hot); for MCH, its row in
        # ``bucket_tables`` (0 for a ZCH table: an answer not used), its default slot; for ZCH, its
        # first slot, bucket rows and buckets (0, 1, 1 for an MCH table). Only a kind's own.
        table_of = [t for t in tables for _ in t.features]
        mch = [t.name in self.sorted_tables for t in table_of]
        columns = [counted.index(t.name) for t in table_of]
        per_feature: dict[str, list] = {"column": [[int(c == k) for k in range(len(counted))] for c in columns]}
        if sorted_kind:
            # placeholders until ``load`` (empty: a 1TB model's would take GBs while its maps are laid out)
            self.register_buffer("sorted_ids", torch.empty(sum(t.rows for t in sorted_kind), dtype=torch.int64))
            self.register_buffer("slots", torch.empty(sum(t.rows for t in sorted_kind), dtype=torch.int64))
            ranges = [self.ranges[t.name] for t in sorted_kind]
            self.register_buffer("bucket_tables", bucket_tables(*zip(*ranges)), persistent=False)
            # derived from sorted_ids at load, each worker's own
            self.register_buffer("bucket_index", torch.empty(0, dtype=torch.int64), persistent=False)
            per_feature["mch_table"] = [self.sorted_tables.index(t.name) if m else 0 for t, m in zip(table_of, mch)]
            per_feature["default_slot"] = [t.rows - 1 for t in table_of]
        if hashed:
            self.register_buffer("identities", torch.empty(sum(t.rows for t in hashed), dtype=torch.int64))
            per_feature["probe_from"] = [0 if m else self.ranges[t.name][0] for t, m in zip(table_of, mch)]
            per_feature["buckets"] = [1 if m else _zch(t).buckets for t, m in zip(table_of, mch)]
            per_feature["bucket_rows"] = [1 if m else t.rows // _zch(t).buckets for t, m in zip(table_of, mch)]
        if sorted_kind and hashed:
            per_feature["is_hashed"] = [not m for m in mch]
        self.dropping_unseen = any(t.remap.drops_unseen for t in hashed)  # type: ignore[union-attr]
        if self.dropping_unseen:
            per_feature["drops_unseen"] = [t.remap.drops_unseen for t in table_of]  # type: ignore[union-attr]
        self.halvings = max((t.rows - 1).bit_length() for t in sorted_kind) if sorted_kind else 0
        # one FBGEMM call per distinct max_probe, over the ids of its tables
        probes = [0 if m else _zch(t).max_probe for t, m in zip(table_of, mch)]
        self.max_probes = sorted(set(probes) - {0})
        self.all_hashed_alike = not sorted_kind and len(self.max_probes) == 1
        if hashed and not self.all_hashed_alike:
            per_feature["probe_group"] = [self.max_probes.index(p) if p else -1 for p in probes]
        for name, values in per_feature.items():
            self.register_buffer(name, torch.tensor(values), persistent=False)
        self.register_buffer("counts", torch.zeros((2, len(counted)), dtype=torch.int64), persistent=False)

    def load(self, maps: Mapping[str, SlotMap]) -> None:
        """Serves the tables' slot maps, used in place (a mapped file's pages stay shared): each
        kind's must lie end to end in table order (``slot_maps.fused``)."""
        for names, parts in ((self.sorted_tables, SORTED_PARTS), (self.hashed_tables, HASHED_PARTS)):
            if not names:
                continue
            wrong = [t for t in names if len(maps[t]) != len(parts)]
            if wrong:
                raise ValueError(f"tables {wrong}: their slot maps must be {' and '.join(parts)}, "
                                 f"got {len(maps[wrong[0]])} part(s)")
            sized = [t for t in names if any(len(part) != self.ranges[t][1] for part in maps[t])]
            if sized:
                t = sized[0]
                raise ValueError(f"table {t}'s slot map must be int64 [{self.ranges[t][1]}] a part, "
                                 f"got {[list(part.shape) for part in maps[t]]}")
            whole = spanned([maps[t] for t in names])
            if whole is None:
                raise ValueError(f"the slot maps of tables {names} do not lie end to end (slot_maps.fused): "
                                 "a weights file written by an older torchrec-serve keeps them apart; rebuild the archive")
            for name, tensor in zip(parts, whole):  # each table's size checked above: the whole's too
                if tensor.dtype != torch.int64:
                    raise ValueError(f"slot maps' {name} must be int64 for tables {names}, got {tensor.dtype}")
                setattr(self, name, tensor)
            if parts == SORTED_PARTS:
                self.bucket_index = index_of(self.sorted_ids, self.bucket_tables)

    def table_maps(self) -> dict[str, SlotMap]:
        """Each table's slot map: views of the served tensors."""
        parts = dict.fromkeys(self.sorted_tables, SORTED_PARTS) | dict.fromkeys(self.hashed_tables, HASHED_PARTS)
        return {
            name: tuple(getattr(self, part)[start : start + rows] for part in parts[name])
            for name, (start, rows) in self.ranges.items()
        }

    def forward(self, ids: torch.Tensor, feature_lengths: torch.Tensor) -> torch.Tensor:
        """Raw ids int64 [V], feature-major, and the ids of each feature int64 [F] -> each id's
        slot in its table, int64 [V]."""
        feature = torch.repeat_interleave(feature_lengths, output_size=ids.shape[0])
        slots, owned = self._sorted(ids, feature) if self.sorted_tables else (ids, ids != ids)
        for group, max_probe in enumerate(self.max_probes):
            slots, owned = self._hashed(ids, feature, group, max_probe, slots, owned)
        missed = torch.nn.functional.pad(torch.cumsum(~owned, 0), (1, 0))
        ends = torch.cumsum(feature_lengths, 0)
        per_feature = torch.stack([missed[ends] - missed[ends - feature_lengths], feature_lengths])
        self.counts.add_((per_feature.unsqueeze(2) * self.column).sum(1))  # [2, F] -> [2, tables]
        return slots

    def first_feature(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of raw ids int64 [V] that are all the first feature's (one table's lookups)."""
        lengths = torch.zeros(len(self.features), dtype=torch.int64)
        lengths[0] = len(ids)
        return self(ids, lengths)

    def _sorted(self, ids: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MCH: the first position of each id's range (``search_range``) whose owner is not below
        it, found by halving; the slot there if that owner is the id, else the default slot."""
        low, high = self.search_range(ids, feature)
        # a graph halves every id's range as often as a whole table needs; run eagerly, as often
        # as this batch's widest range needs (a window's few where every window holds)
        if torch.compiler.is_compiling():
            halvings = self.halvings
        else:
            halvings = int((high - low).max()).bit_length() if len(ids) else 0
        low = _first_not_below(self.sorted_ids, ids, low, high, halvings)
        owned = self.sorted_ids[low] == ids
        if self.hashed_tables:
            owned &= ~self.is_hashed[feature]
        return torch.where(owned, self.slots[low], self.default_slot[feature]), owned

    def search_range(self, ids: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MCH ids int64 [V] of ``feature`` int64 [V] -> where to search each, [low, high]: the
        window of its bucket in its table's bucket index, where the owners on either side confirm
        that it holds the id's place; else (a delta moved the owners since the index was made)
        the whole table."""
        table = self.bucket_tables[self.mch_table[feature]]  # [V, 4]
        first, offset = table[:, FIRST], table[:, OFFSET]
        last = first + table[:, ROWS] - 1
        shift, base = self.bucket_index[offset], self.bucket_index[offset + 1]
        bucket = torch.minimum(torch.clamp((ids >> shift) - base, min=0), table[:, BUCKETS] - 1)
        start = offset + HEADER + bucket
        low, high = first + self.bucket_index[start], first + self.bucket_index[start + 1]
        holds = ((low == first) | (self.sorted_ids[torch.clamp(low - 1, min=0)] < ids)) & (
            (high == last) | (self.sorted_ids[high] >= ids)
        )
        return torch.where(holds, low, first), torch.where(holds, high, last)

    def _hashed(
        self, ids: torch.Tensor, feature: torch.Tensor, group: int, max_probe: int, slots: torch.Tensor,
        owned: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ZCH, the ids of the tables that probe ``max_probe`` slots: FBGEMM's probing within each
        id's bucket, given as a range of ``identities``; where no slot holds the id, its first probe."""
        at = None if self.all_hashed_alike else torch.nonzero(self.probe_group[feature] == group).flatten()
        mine, of = (ids, feature) if at is None else (ids[at], feature[at])
        bucket_rows = self.bucket_rows[of]
        first = self.probe_from[of] + torch.remainder(mine, self.buckets[of]) * bucket_rows
        found = tbe.zch_slots(mine, self.identities, max_probe, bucket_rows, first)
        hit = self.identities[found] == mine
        local = found - self.probe_from[of]
        if self.dropping_unseen:
            local = torch.where(hit | ~self.drops_unseen[of], local, -1)
        if at is None:
            return local, hit
        return slots.index_put((at,), local), owned.index_put((at,), hit)


def _first_not_below(
    values: torch.Tensor, ids: torch.Tensor, low: torch.Tensor, high: torch.Tensor, halvings: int
) -> torch.Tensor:
    """Per id, the first position in ``[low, high)`` whose value (sorted within it) is not below
    the id, or ``high``: ``halvings`` halving steps, enough for the widest range; an id whose
    range is settled reads the same value again (cached)."""
    for _ in range(halvings):
        active = low < high
        middle = (low + high) >> 1
        above = active & (values[middle] < ids)
        low = torch.where(above, middle + 1, low)
        high = torch.where(active & ~above, middle, high)
    return low


def _zch(table: TableSpec) -> RemapSpec:
    assert table.remap is not None and table.remap.kind == RemapKind.ZCH, f"{table.name} is not a zch table"
    return table.remap


def _ranges(tables: Sequence[TableSpec]) -> dict[str, tuple[int, int]]:
    """Each table's first slot and rows, end to end."""
    ranges, at = {}, 0
    for t in tables:
        ranges[t.name], at = (at, t.rows), at + t.rows
    return ranges
