"""Writing delta rows into the served tables in place, with no torn row, at a set pace.

The tables of an ``eager`` or ``aoti`` archive are memory-mapped from the extracted weights file
by every worker of the model (``torch.load(mmap=True)``: private mappings that workers never write,
so they keep reading the file's page cache). One writer maps the same file shared and copies the
new rows into it: every worker sees them at once, and the tables are never held twice.

A row must never be read half-written. Every forward holds the model's row lock shared
(``RowLock.reading``: ``flock(LOCK_SH)`` on a lock file beside the weights, two system calls per
forward); the writer takes it exclusively for one chunk of rows at a time (``chunk_rows``, a few
hundred microseconds of copying), so a forward waits at most one chunk, and sees each row either
before or after it was written. Between chunks the writer sleeps to keep to ``rows_per_s``.

Progress is kept in ``freshness-state.json`` beside the weights (written under the lock after each
chunk): the sequence applied completely, and how far into the next delta the writer got. A writer
that dies mid-delta is resumed by the next (rows are whole bytes, writing one twice is harmless).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import mmap
import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import orjson
import torch

from handlers.runtime.freshness.delta_file import Delta
from handlers.runtime.freshness.layout import TablesLayout

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
    def sole_writer(self, folder: Path) -> Iterator[bool]:
        """Whether this process is the model's one writer now (a second lock file)."""
        fd = os.open(Path(folder) / (LOCK_FILE + ".writer"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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

    ``buffers``: the TBE buffers as this process mapped them from that file; their offsets in the
    file are read from the process's own mappings (``/proc/self/maps``)."""

    def __init__(self, weights_file: Path, buffers: list[torch.Tensor], layout: TablesLayout) -> None:
        self.layout = layout
        self._file = open(weights_file, "r+b")
        self._map = mmap.mmap(self._file.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        data = np.frombuffer(self._map, dtype=np.uint8)
        starts = [file_offset(b, weights_file) for b in buffers]
        self._tables = {
            t.name: data[starts[t.buffer] + t.offset : starts[t.buffer] + t.offset + t.rows * t.row_bytes].reshape(
                t.rows, t.row_bytes
            )
            for t in layout.tables
        }

    def write(self, table: str, records: np.ndarray) -> None:
        """Copies (id, row) records into the table."""
        self._tables[table][records["id"]] = records["row"]

    def rows(self, table: str, ids: np.ndarray) -> np.ndarray:
        return self._tables[table][ids].copy()


def file_offset(tensor: torch.Tensor, path: Path) -> int:
    """Where ``tensor``'s first byte lies in the file ``path``, which this process has mapped."""
    address = tensor.data_ptr()
    target = str(Path(path).resolve())
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == target:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return address - start + int(fields[2], 16)
    raise ValueError(f"the tensor at {address:#x} is not mapped from {target}")


@dataclasses.dataclass(frozen=True)
class Pace:
    rows_per_s: float = 200_000.0
    chunk_rows: int = 4096


def apply_delta(
    delta: Delta, writer: TableWriter, lock: RowLock, folder: Path, pace: Pace, start_row: int = 0
) -> AppliedState:
    """Writes ``delta`` (validated) from its ``start_row``-th row on, chunk by chunk under the
    lock, recording progress; returns the state after it."""
    state = AppliedState.read(folder)
    done = 0
    started = time.perf_counter()
    for section in delta.header.tables:
        for chunk in delta.chunks(section, pace.chunk_rows):
            if done + len(chunk) <= start_row:
                done += len(chunk)
                continue
            chunk = chunk[max(0, start_row - done):]
            with lock.writing():
                writer.write(section.name, chunk)
                done = max(done, start_row) + len(chunk)
                state = dataclasses.replace(
                    state, partial=done, rows_applied=state.rows_applied + len(chunk), updated_at=time.time()
                )
                state.write(folder)
            ahead = done / pace.rows_per_s - (time.perf_counter() - started)
            if ahead > 0:
                time.sleep(ahead)
    with lock.writing():
        state = dataclasses.replace(state, sequence=delta.header.sequence, partial=0, updated_at=time.time())
        state.write(folder)
    return state
