"""Writing delta rows into the served tables in place, with no torn row, at a set pace.

The tables of an ``eager`` or ``aoti`` archive are memory-mapped by every worker of the model from
one working copy of the archive's weights file in shared memory (``shared_tables``;
``torch.load(mmap=True)``: private mappings that workers never write, so they keep reading the
file's pages). One writer maps the same file shared and copies the new rows into it: every worker
sees them at once, and the tables are never held twice.

A row must never be read half-written. Every forward holds the model's row lock shared
(``RowLock.reading``: ``flock(LOCK_SH)`` on a lock file beside the working copy, two system calls per
forward); the writer takes it exclusively for one chunk of rows at a time (``chunk_rows``, a few
hundred microseconds of copying), so a forward waits at most one chunk, and sees each row either
before or after it was written. Nothing slow happens under the lock: the chunk's pages are made
present and writable first (pinned: ``shared_tables.pin_in_memory``; where pinning failed,
``TableWriter.touch`` writes each row back as it is, which page faults and the file system's
first-write work cost), and progress is recorded after the lock is released. Between chunks the
writer sleeps to keep to ``rows_per_s``.

Progress is kept in ``freshness-state.json`` beside the working copy (written after each chunk): the
sequence applied completely, and how far into the next delta the writer got. A writer
that dies mid-delta is resumed by the next (rows are whole bytes, writing one twice is harmless).

A raw-id table's records also move slots between raw ids: its slot map (``slot_maps``), which
every worker maps from the same file, is rebuilt from the new owners outside the lock (on the
writer's thread, about 1 s at 11M slots), and the part of it that differs is copied in during
one hold of the lock with the rows of the slots that change owner (``slot_writes``): a forward
sees the old owners with the old rows or the new with the new, never an id with another id's row.
That hold is longer than a chunk's (13-22 ms at 11M slots).

The rows a delta overwrites are kept for a rollback (``UndoLog``): each chunk's rows are read just
before the chunk is written, in the same pass (the write then finds them in the cache; a separate
pass over 100k random rows cost 16 ms in one burst), and appended to the delta's undo file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import mmap
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np
import orjson
import torch

from handlers.runtime.freshness.delta_file import Delta, DeltaWriter, TableSection
from handlers.runtime.freshness.layout import TablesLayout
from handlers.runtime.freshness.shared_tables import mappings
from handlers.runtime.freshness.slot_writes import StagedMap, write_slots
from handlers.runtime.slot_maps import SlotMap, is_hashed, owners_of, slot_map

LOCK_FILE = "freshness.lock"
STATE_FILE = "freshness-state.json"


class RowLock:
    """The model's cross-process reader/writer lock on its table rows (one per process and role:
    flock locks belong to the open file, so a reader and a writer in one process still exclude
    each other)."""

    def __init__(self, folder: Path) -> None:
        self._fd = os.open(Path(folder) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def sole_writer(self, folder: Path, wait: bool = False) -> Iterator[bool]:
        """Whether this process is the model's one writer now (a second lock file); ``wait``:
        until the writer there is finishes."""
        fd = os.open(Path(folder) / (LOCK_FILE + ".writer"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)


@dataclasses.dataclass
class AppliedState:
    """``sequence``: the last delta applied in full; ``partial``: rows of delta ``sequence + 1``
    already written (a writer resumes there)."""

    sequence: int = 0
    partial: int = 0
    rows_applied: int = 0
    updated_at: float = 0.0

    @classmethod
    def read(cls, folder: Path) -> "AppliedState":
        try:
            return cls(**orjson.loads((Path(folder) / STATE_FILE).read_bytes()))
        except FileNotFoundError:
            return cls()

    def write(self, folder: Path) -> None:
        path = Path(folder) / STATE_FILE
        staged = path.with_name(path.name + ".tmp")
        staged.write_bytes(orjson.dumps(dataclasses.asdict(self)))
        os.replace(staged, path)  # readers see the old state or the new one


class TableWriter:
    """Shared, writable views of the tables in ``weights_file``, a file the model's workers map.

    ``buffers``: the TBE buffers as this process mapped them from that file, and ``slot_maps``
    its raw-id tables' slot maps (``slot_maps.slot_maps_in``); their offsets in the file are read
    from the process's own mappings (``/proc/self/maps``)."""

    def __init__(
        self, weights_file: Path, buffers: list[torch.Tensor], layout: TablesLayout,
        slot_maps: Mapping[str, SlotMap] | None = None,
    ) -> None:
        self.layout = layout
        self.pinned = False  # set once its pages are mapped and locked: no write faults then
        self._file = open(weights_file, "r+b")
        self._map = mmap.mmap(self._file.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        data = np.frombuffer(self._map, dtype=np.uint8)
        starts = [file_offset(b, weights_file) for b in buffers]
        # torch views of the mapping: their copies run without holding the GIL, so the worker's
        # forwards (this process's other thread) go on while the writer copies.
        self._tables = {
            t.name: torch.from_numpy(
                data[starts[t.buffer] + t.offset : starts[t.buffer] + t.offset + t.rows * t.row_bytes]
            ).view(t.rows, t.row_bytes)
            for t in layout.tables
        }
        maps = slot_maps or {}
        missing = sorted(t.name for t in layout.tables if t.raw_ids and t.name not in maps)
        if missing:
            raise ValueError(f"{weights_file}: raw-id tables {missing} have no slot map in it")
        self._maps: dict[str, SlotMap] = {
            name: tuple(  # type: ignore[misc]
                torch.from_numpy(data[start : start + t.numel() * 8]).view(torch.int64)
                for t in pair for start in (file_offset(t, weights_file),)
            )
            for name, pair in maps.items()
        }

    def write(self, table: str, records: np.ndarray, staged: StagedMap | None = None) -> None:
        """Copies (id, row) records into the table, and ``staged``, the changed span of its slot
        map, into its map (hold the row lock)."""
        self._tables[table].index_copy_(0, _index(records["id"]), torch.from_numpy(np.array(records["row"])))
        if staged is not None:
            for served, new in zip(self._maps[table], staged.parts):
                if staged.scattered:
                    served.index_copy_(0, staged.moved, new)
                else:
                    served[staged.start : staged.start + staged.length].copy_(new)

    def slot_map(self, table: str) -> SlotMap:
        """A raw-id table's slot map, as every worker maps it."""
        return self._maps[table]

    def owners(self, table: str, slots: np.ndarray) -> np.ndarray:
        """The raw ids that own ``slots`` of a raw-id table now."""
        return owners_of(self._maps[table])[_index(slots)].numpy()

    def owned_slots(self, table: str, ids: np.ndarray) -> np.ndarray:
        """The slot each raw id owns now (-1: none)."""
        served = self._maps[table]
        sorted_ids, slots = slot_map(owners_of(served)) if is_hashed(served) else served
        ids = _index(ids)
        found = torch.searchsorted(sorted_ids[:-1], ids)
        return torch.where(sorted_ids[found] == ids, slots[found], -1).numpy()

    def touch_map(self, table: str, staged: StagedMap) -> None:
        """Writes the entries of a slot map that ``staged`` changes back as they are (``touch``,
        for the map's pages)."""
        for tensor in self._maps[table]:
            if staged.scattered:
                tensor.index_copy_(0, staged.moved, tensor.index_select(0, staged.moved))
            else:
                span = slice(staged.start, staged.start + staged.length)
                tensor[span].copy_(tensor[span].clone())

    def touch(self, table: str, ids: np.ndarray) -> None:
        """Writes the rows ``ids`` back as they are: their pages become present and writable in
        this mapping (the page faults, and the file system's work on a first write to a page,
        happen here, outside the lock), and no reader can tell."""
        rows, index = self._tables[table], _index(ids)
        rows.index_copy_(0, index, rows.index_select(0, index))

    def rows(self, table: str, ids: np.ndarray) -> np.ndarray:
        return self._tables[table].index_select(0, _index(ids)).numpy()


def _index(ids: np.ndarray) -> torch.Tensor:
    """Row ids (any view: a field of the delta's records) as an index tensor of their own."""
    return torch.from_numpy(np.array(ids, dtype=np.int64))


def file_offset(tensor: torch.Tensor, path: Path) -> int:
    """Where ``tensor``'s first byte lies in the file ``path``, which this process has mapped."""
    address = tensor.data_ptr()
    for mapping in mappings(path):
        if mapping.start <= address < mapping.end:
            return address - mapping.start + mapping.offset
    raise ValueError(f"the tensor at {address:#x} is not mapped from {Path(path).resolve()}")


@dataclasses.dataclass(frozen=True)
class Pace:
    """How fast a writer applies rows, and how many it writes per hold of the lock (the model
    config's ``freshness`` section: ``freshness.config``)."""

    rows_per_s: float = 80_000.0
    chunk_rows: int = 4096


def apply_delta(
    delta: Delta,
    writer: TableWriter,
    lock: RowLock,
    folder: Path,
    pace: Pace,
    start_row: int = 0,
    undo: Path | None = None,
) -> AppliedState:
    """Writes ``delta`` (validated) from its ``start_row``-th row on, chunk by chunk under the
    lock, recording progress; returns the state after it. ``undo``: where to keep the rows it
    overwrites, as a delta of the same sequence (``UndoLog``; one that is complete already is kept
    as it is: a replay finds the same rows)."""
    state = AppliedState.read(folder)

    def progress(done: int, rows: int) -> None:
        nonlocal state
        state = dataclasses.replace(state, partial=done, rows_applied=state.rows_applied + rows, updated_at=time.time())
        state.write(folder)

    kept = UndoLog(undo, delta, writer) if undo is not None and not undo.exists() else None
    try:
        write_rows(delta, writer, lock, pace, start_row, progress, kept, staging=folder)
    finally:
        if kept is not None:
            kept.close()  # on disk before the state says the delta is applied
    state = dataclasses.replace(state, sequence=delta.header.sequence, partial=0, updated_at=time.time())
    state.write(folder)
    return state


def write_rows(
    delta: Delta,
    writer: TableWriter,
    lock: RowLock,
    pace: Pace,
    start_row: int = 0,
    progress: Callable[[int, int], None] | None = None,
    undo: UndoLog | None = None,
    staging: Path | None = None,
) -> None:
    """The delta's rows from the ``start_row``-th on into the tables, one chunk per hold of the
    lock, at ``pace``; ``progress(rows done, rows just written)`` after each chunk, outside the
    lock (a file write can wait on the disk; a resumed writer writes a few rows twice, the same
    bytes). ``undo``: keeps each chunk's rows as they were before the chunk is written. A
    raw-id section is written whole (``slot_writes.write_slots``; ``staging``: the folder that
    keeps its new slot map until written) and its progress recorded after it."""
    if undo is not None and undo.rows < start_row:
        raise RuntimeError(f"{undo.path}: holds the old values of {undo.rows} rows of delta {delta.header.sequence}, "
                           f"but {start_row} are written already: its undo is lost (was the log folder changed?)")
    done = written = 0
    started = time.perf_counter()

    def pause(rows: int) -> None:  # keeps to the pace
        nonlocal written
        written += rows
        ahead = written / pace.rows_per_s - (time.perf_counter() - started)
        if ahead > 0:
            time.sleep(ahead)

    for section in delta.header.tables:
        if section.owners:
            if done + section.count > start_row and section.count:
                if undo is not None:
                    undo.keep(section, delta.records(section), done)
                write_slots(delta, section, writer, lock, pace.chunk_rows, staging, pause)
                if progress is not None:
                    progress(done + section.count, section.count)
            done += section.count
            continue
        for chunk in delta.chunks(section, pace.chunk_rows):
            if done + len(chunk) <= start_row:
                done += len(chunk)
                continue
            chunk = chunk[max(0, start_row - done):]
            first = max(done, start_row)
            if undo is not None:
                undo.keep(section, chunk, first)
            if not writer.pinned:
                writer.touch(section.name, chunk["id"])  # the only writer: those bytes stay as they are
            with lock.writing():  # held for a copy of the rows alone
                writer.write(section.name, chunk)
            done = first + len(chunk)
            if progress is not None:
                progress(done, len(chunk))
            pause(len(chunk))


class UndoLog:
    """The rows a delta overwrites, as they were: a delta of the same sequence that restores them
    (the rollback's), written chunk by chunk, each chunk's rows handed to the OS before the chunk
    is written, and completed (flushed to disk) once the whole delta is.

    A writer that dies midway leaves ``<path>.partial``: every row in it was read before it
    changed, and some of them may be written already, so the next writer keeps them all (whole
    records whose ids are the delta's) and goes on after them. Rows are counted through the
    delta's sections in order, as ``write_rows`` counts them."""

    def __init__(self, path: Path, delta: Delta, writer: TableWriter) -> None:
        header = delta.header
        self.path = path
        self._writer = writer
        partial, earlier = path.with_name(path.name + ".partial"), path.with_name(path.name + ".partial.kept")
        if partial.exists() and not earlier.exists():  # (kept already: a writer died keeping it again)
            os.replace(partial, earlier)
        self._out = DeltaWriter(path, model=header.model, base=header.base, sequence=header.sequence)
        self._total = header.rows
        self.rows = 0
        if earlier.exists():
            self._keep_earlier(earlier, delta)
            earlier.unlink()

    def keep(self, section: TableSection, chunk: np.ndarray, first: int) -> None:
        """Keeps the rows of ``chunk`` (the delta's rows ``first`` on) that it does not hold yet."""
        new = chunk["id"][max(0, self.rows - first):]
        if len(new):
            owners = self._writer.owners(section.name, new) if section.owners else None
            self._out.add(self._writer.layout.table(section.name), new, self._writer.rows(section.name, new), owners)
            self._out.flush()
            self.rows = first + len(chunk)

    def close(self) -> None:
        """Completes the file once it holds every row of the delta; else leaves it to be resumed."""
        if self.rows == self._total:
            self._out.close()
        else:
            self._out.release()

    def _keep_earlier(self, earlier: Path, delta: Delta) -> None:
        """The records of an earlier writer's undo, as far as they are whole and the delta's."""
        data = np.memmap(earlier, dtype=np.uint8, mode="r") if earlier.stat().st_size else np.empty(0, np.uint8)
        at = 0
        for section in delta.header.tables:
            size = section.records.itemsize
            whole = min(section.count, (len(data) - at) // size)
            records = data[at : at + whole * size].view(section.records)
            differ = np.flatnonzero(records["id"] != delta.records(section)["id"][:whole])
            same = int(differ[0]) if len(differ) else whole  # the leading records with the delta's ids
            if same:
                owners = records["owner"][:same] if section.owners else None
                self._out.add(self._writer.layout.table(section.name), records["id"][:same], records["row"][:same], owners)
            self.rows += same
            at += whole * size
            if same < section.count:
                break
        self._out.flush()
