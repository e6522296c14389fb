"""Writing a raw-id table's section of a delta: slots that change owner move with their rows.

The section's records are (slot, owner, row). The slots whose owner changes and the new slot map
(``slot_maps.with_owners``, rebuilt outside the lock) go in one hold of the row lock; the other
records (trained rows of slots that keep their owner) go in chunks at the model's pace, like an
index table's rows. The new map's changed entries (MCH: a span; ZCH: the moved slots) are staged
in a file in the working copy's folder before the hold: a writer that dies during the copy
leaves the map half written, and the next writer copies the staged entries again rather than
building a map from a torn one.

    write_slots(delta, section, writer, lock, chunk_rows, staging=folder, pause=pacer)
    check_owners(writer, delta, pending)   # at publish: no id would own two slots
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from handlers.runtime.freshness.delta_file import Delta, DeltaError, TableSection
from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT
from handlers.runtime.slot_maps import is_hashed, owners_of, with_owners

if TYPE_CHECKING:
    from handlers.runtime.freshness.applier import RowLock, TableWriter


@dataclasses.dataclass(frozen=True)
class StagedMap:
    """A raw-id table's new slot map, as far as it differs from the served one, and the slots that
    change owner; ``key`` names the delta section it was made for. MCH's sorted map shifts between
    its first and last change: ``parts`` hold each part's entries ``start`` to ``start + length``;
    ZCH's identities are row-aligned: ``parts`` hold those of the ``moved`` slots alone
    (``scattered``)."""

    key: str
    start: int
    parts: tuple[torch.Tensor, ...]  # as the map's (slot_maps.SlotMap), cut to the span or the moved slots
    moved: torch.Tensor  # int64 [m]: slots whose owner changes
    scattered: bool = False

    @property
    def length(self) -> int:
        return len(self.parts[0])

    def save(self, path: Path) -> None:
        staged = path.with_name(path.name + ".tmp")
        torch.save(dataclasses.asdict(self), staged)
        staged.replace(path)

    @classmethod
    def load(cls, path: Path, key: str) -> "StagedMap | None":
        """The entries staged at ``path`` for ``key``; None if there are none (or some for another)."""
        try:
            saved = torch.load(path, weights_only=True)
        except FileNotFoundError:
            return None
        return cls(**{**saved, "parts": tuple(saved["parts"])}) if saved.get("key") == key else None


def stage(writer: TableWriter, table: str, records: np.ndarray, key: str) -> StagedMap:
    """The slot map after the (slot, owner, row) ``records``, built outside the lock."""
    served = writer.slot_map(table)
    slots, owners = _index(records["id"]), _index(records["owner"])
    if is_hashed(served) and bool((owners == ZCH_EMPTY_SLOT).any()):
        why = f"raw id {ZCH_EMPTY_SLOT} marks an empty slot of a zch table: it owns none"
        raise DeltaError(f"tables.{table}.owners", why)
    now = owners_of(served)
    moved = slots[now[slots] != owners]
    try:
        new = with_owners(now, slots, owners, hashed=is_hashed(served))
    except ValueError as e:
        raise DeltaError(f"tables.{table}.owners", str(e)) from None
    if is_hashed(served):
        return StagedMap(key, 0, tuple(part[moved] for part in new), moved, scattered=True)
    differ = torch.nonzero(torch.stack([a != b for a, b in zip(new, served)]).any(dim=0)).flatten()
    start, end = (int(differ[0]), int(differ[-1]) + 1) if len(differ) else (0, 0)
    return StagedMap(key, start, tuple(part[start:end].clone() for part in new), moved)


def write_slots(
    delta: Delta,
    section: TableSection,
    writer: TableWriter,
    lock: RowLock,
    chunk_rows: int,
    staging: Path | None,
    pause: Callable[[int], None],
) -> None:
    """Writes a raw-id section whole (``pause(rows)`` after each hold of the lock); ``staging``:
    the folder where the new map's changed entries are kept until written (None: not kept)."""
    records = delta.records(section)
    key = f"{delta.path.name}:{section.xxh3_128}"
    path = None if staging is None else Path(staging) / f"staged-map-{section.name}.pt"
    staged = None if path is None else StagedMap.load(path, key)  # a writer died under the lock
    if staged is None:
        staged = stage(writer, section.name, records, key)
        if path is not None:
            staged.save(path)
    moved = np.isin(records["id"], staged.moved.numpy())
    if not writer.pinned:
        writer.touch(section.name, records["id"][moved])
        writer.touch_map(section.name, staged)
    with lock.writing():
        writer.write(section.name, records[moved], staged)
    pause(int(moved.sum()))
    kept = records[~moved]
    for start in range(0, len(kept), chunk_rows):
        chunk = kept[start : start + chunk_rows]
        if not writer.pinned:
            writer.touch(section.name, chunk["id"])
        with lock.writing():
            writer.write(section.name, chunk)
        pause(len(chunk))
    if path is not None:
        path.unlink(missing_ok=True)


def check_owners(writer: TableWriter, delta: Delta, pending: Sequence[Delta]) -> None:
    """Raises ``DeltaError`` when a raw-id section of ``delta`` gives a raw id a slot while that
    id keeps another slot the section leaves alone, in the tables as they will be once the
    ``pending`` deltas (in the log, not applied yet) are."""
    for section in delta.header.tables:
        if not section.owners:
            continue
        records = delta.records(section)
        later: dict[int, int] = {}  # slot -> owner, as the pending deltas leave them
        for earlier in pending:
            for other in earlier.header.tables:
                if other.name == section.name:
                    written = earlier.records(other)
                    later.update(zip(written["id"].tolist(), written["owner"].tolist()))
        given = records["owner"] != MCH_FREE_SLOT
        owners, slots = records["owner"][given], records["id"][given]
        held = writer.owned_slots(section.name, owners)  # each owner's slot now (-1: none)
        for i in np.flatnonzero((held >= 0) & ~np.isin(held, records["id"])).tolist():
            owner, now = int(owners[i]), int(held[i])
            if later.get(now, owner) == owner:  # no pending delta moves the id away from it
                _conflict(section, owner, int(slots[i]), now)
        if later:
            pending_slots, pending_owners = np.array(list(later), np.int64), np.array(list(later.values()), np.int64)
            slot_of = dict(zip(owners.tolist(), slots.tolist()))
            for j in np.flatnonzero(~np.isin(pending_slots, records["id"]) & np.isin(pending_owners, owners)).tolist():
                _conflict(section, int(pending_owners[j]), slot_of[int(pending_owners[j])], int(pending_slots[j]))


def _conflict(section: TableSection, owner: int, slot: int, kept: int) -> None:
    raise DeltaError(f"tables.{section.name}.owners", f"gives raw id {owner} slot {slot} while it keeps slot {kept}, "
                     "which this delta leaves as it is: an id owns one slot (make the delta from the served state)")


def _index(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64))
