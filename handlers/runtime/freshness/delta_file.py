"""The delta file: the rows of a model's tables that changed, in their served form, and
optionally the whole dense part's new weights, for one publish. Written in one pass (a table of any
size streams through in chunks), read back by mapping it, and checked whole before anything is
applied.

Layout: the table sections, the dense section, then a JSON header, then the header's length (u64,
little-endian) and the magic ``TRSDELT1``::

    [table 0: count x (id int64 LE, row row_bytes)] [table 1] ... [dense tensors] [header] [u64] [magic]

    {"format": 1, "model": "criteo", "base": "<fingerprint of the archive's weights>",
     "sequence": 3, "created_at": "2026-11-23T07:00:00+00:00",
     "tables": [{"name": "cat_0", "dtype": "int8", "dim": 64, "row_bytes": 68, "count": 1000,
                 "offset": 0, "xxh3_128": "..."}],
     "dense": {"offset": 68000, "xxh3_128": "...", "tensors": [
                 {"name": "model.over_arch.model.0._mlp.0._linear.weight", "dtype": "float32",
                  "shape": [512, 479], "offset": 0, "nbytes": 980992}, ...]}}   # or null

A raw-id table's section (``"owners": true``) has records ``(id int64, owner int64, row)``: the
raw id that owns the slot from this delta on (``MCH_FREE_SLOT``: none), applied with its row
(``slot_writes``), so an id never meets another id's row.

A table's ids are strictly increasing (each once, in order): checking that is one pass where
finding repeats in any order took a sort (3 ms of the 4.5 ms a 100k-row delta's check took, on the
worker thread that serves), and a writer walks the table's memory in order. A row is exactly
what the table holds (``layout.TableLayout``), so applying one is a copy. The
dense tensors are named and shaped as the served artifact holds them (an AOTInductor package's
constants, an eager archive's float dense state): every one of them, since dense weights swap whole.

The checksums (xxh3-128) guard against a damaged or half-copied file, not against tampering (the
files come from the model store, behind the management token); they are checked on a worker
before a publish is answered, so they must be fast: 1 ms for a 100k-row delta, where sha256
took 9.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import struct
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import orjson
import torch
import xxhash

from handlers.runtime.errors import BadRequest
from handlers.runtime.freshness.layout import TableLayout, TablesLayout
from handlers.runtime.inputs import MCH_FREE_SLOT

MAGIC = b"TRSDELT1"
FORMAT = 3  # 2: ids in any order; 1: sha256 checksums
_TRAILER = struct.Struct("<Q8s")


def record_dtype(row_bytes: int, owners: bool = False) -> np.dtype:
    """One record of a table section: the row id (a raw-id table's slot), the raw id that owns
    it (``owners``: a raw-id table's section), and the row's bytes."""
    owner = [("owner", "<i8")] if owners else []
    return np.dtype([("id", "<i8"), *owner, ("row", np.uint8, (row_bytes,))])


class DeltaError(BadRequest):
    """A delta that cannot be applied; the field names the part of it that is wrong."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem, "bad_delta")


@dataclasses.dataclass(frozen=True)
class TableSection:
    name: str
    dtype: str
    dim: int
    row_bytes: int
    count: int
    offset: int
    xxh3_128: str
    owners: bool = False  # records name each slot's raw-id owner (a raw-id table)

    @property
    def records(self) -> np.dtype:
        return record_dtype(self.row_bytes, self.owners)


@dataclasses.dataclass(frozen=True)
class DenseTensor:
    name: str
    dtype: str  # torch's name: float32, bfloat16, int8, ...
    shape: tuple[int, ...]
    offset: int  # from the dense section's start
    nbytes: int


@dataclasses.dataclass(frozen=True)
class DenseSection:
    offset: int
    xxh3_128: str
    tensors: tuple[DenseTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


# What a dense section must hold: every served dense tensor's (dtype, shape), by name.
DenseShapes = Mapping[str, tuple[str, tuple[int, ...]]]


def dense_shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (_dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class DeltaHeader:
    model: str
    base: str
    sequence: int
    created_at: str
    tables: tuple[TableSection, ...]
    dense: DenseSection | None = None

    @property
    def rows(self) -> int:
        return sum(t.count for t in self.tables)


class DeltaWriter:
    """Writes one delta file; ``path`` appears only when ``close()`` completes it.

        with DeltaWriter(path, model="criteo", base=layout.fingerprint, sequence=1) as out:
            out.add(layout.table("cat_0"), ids, rows)       # int64 [n], uint8 [n, row_bytes]
        out.add_dense({"model.over_arch...weight": tensor, ...})  # optional, after the tables
    """

    def __init__(self, path: Path, *, model: str, base: str, sequence: int) -> None:
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self._partial, "wb")
        self._header = {"format": FORMAT, "model": model, "base": base, "sequence": sequence,
                        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        self._sections: dict[str, dict] = {}
        self._hashes: dict[str, xxhash.xxh3_128] = {}
        self._current: str | None = None
        self._last_id = -1  # of the current table: its ids must keep increasing
        self._dense: dict | None = None

    def add(self, table: TableLayout, ids: np.ndarray, rows: np.ndarray, owners: np.ndarray | None = None) -> None:
        """Appends rows of ``table``; a table's chunks must come one after another, its ids
        strictly increasing through them. ``owners`` (int64 [n]): of a raw-id table's slots, and
        only of those."""
        if (owners is not None) != table.raw_ids:
            raise ValueError(f"table {table.name}: its records {'need' if table.raw_ids else 'take no'} owners "
                             f"({'a' if table.raw_ids else 'not a'} raw-id table)")
        if self._dense is not None:
            raise ValueError("the dense section comes after every table's rows")
        if table.name in self._sections and self._current != table.name:
            raise ValueError(f"table {table.name}: its rows must be added in one run")
        if table.name not in self._sections:
            self._sections[table.name] = {
                "name": table.name, "dtype": table.dtype, "dim": table.dim, "row_bytes": table.row_bytes,
                "count": 0, "offset": self._file.tell(), **({"owners": True} if table.raw_ids else {}),
            }
            self._hashes[table.name] = xxhash.xxh3_128()
            self._last_id = -1
        self._current = table.name
        ids = np.asarray(ids, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.uint8)
        if rows.shape != (len(ids), table.row_bytes):
            raise ValueError(f"table {table.name}: rows must be uint8 [{len(ids)}, {table.row_bytes}], got {rows.shape}")
        if len(ids) and (ids[0] <= self._last_id or not _increasing(ids)):
            raise ValueError(f"table {table.name}: ids must be strictly increasing through its chunks (sorted, each once)")
        self._last_id = int(ids[-1]) if len(ids) else self._last_id
        records = np.empty(len(ids), record_dtype(table.row_bytes, table.raw_ids))
        records["id"] = ids
        records["row"] = rows
        if owners is not None:
            records["owner"] = np.asarray(owners, dtype=np.int64)
        data = records.tobytes()
        self._file.write(data)
        self._hashes[table.name].update(data)
        self._sections[table.name]["count"] += len(ids)

    def add_dense(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The dense part's new weights, every tensor of it, as the served artifact names them."""
        if self._dense is not None:
            raise ValueError("a delta holds one dense section")
        start, checksum, entries = self._file.tell(), xxhash.xxh3_128(), []
        for name, tensor in tensors.items():
            data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            entries.append({"name": name, "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape),
                            "offset": self._file.tell() - start, "nbytes": len(data)})
            self._file.write(data)
            checksum.update(data)
        self._dense = {"offset": start, "xxh3_128": checksum.hexdigest(), "tensors": entries}

    def flush(self) -> None:
        """Hands what is added so far to the OS: it outlives this process (not the machine)."""
        self._file.flush()

    def release(self) -> None:
        """Closes the file unfinished, leaving ``<path>.partial`` for a later writer to resume."""
        self._file.close()

    def close(self) -> Path:
        tables = []
        for name, section in self._sections.items():
            tables.append({**section, "xxh3_128": self._hashes[name].hexdigest()})
        header = orjson.dumps({**self._header, "tables": tables, "dense": self._dense})
        self._file.write(header)
        self._file.write(_TRAILER.pack(len(header), MAGIC))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._partial, self.path)
        return self.path

    def __enter__(self) -> "DeltaWriter":
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()
            self._partial.unlink(missing_ok=True)


@dataclasses.dataclass
class Delta:
    """A delta file, read and checked against the served layout."""

    path: Path
    header: DeltaHeader
    _data: np.ndarray  # the file, mapped

    def records(self, table: TableSection) -> np.ndarray:
        """The table's (id, row) or (id, owner, row) records, mapped from the file."""
        end = table.offset + table.count * table.records.itemsize
        return self._data[table.offset : end].view(table.records)

    def chunks(self, table: TableSection, rows_per_chunk: int) -> Iterator[np.ndarray]:
        records = self.records(table)
        for start in range(0, len(records), rows_per_chunk):
            yield records[start : start + rows_per_chunk]

    def dense(self) -> dict[str, torch.Tensor]:
        """The dense section's tensors, copied out of the file (the inactive copy a swap fills)."""
        section = self.header.dense
        if section is None:
            return {}
        tensors = {}
        for t in section.tensors:
            start = section.offset + t.offset
            raw = torch.from_numpy(self._data[start : start + t.nbytes].copy())
            tensors[t.name] = raw.view(getattr(torch, t.dtype)).reshape(t.shape)
        return tensors


def read_header(path: Path) -> DeltaHeader:
    """The header alone; a file that is not a whole delta is a ``DeltaError``."""
    return _read_header(path)[0]


def _read_header(path: Path) -> tuple[DeltaHeader, int]:
    """(the header, where it starts: the sections end there)."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        if size < _TRAILER.size:
            raise DeltaError("delta", f"{size} bytes: truncated, or not a delta file")
        file.seek(size - _TRAILER.size)
        length, magic = _TRAILER.unpack(file.read(_TRAILER.size))
        if magic != MAGIC or length > size - _TRAILER.size:
            raise DeltaError("delta", "no delta trailer at the end: truncated, or not a delta file")
        file.seek(size - _TRAILER.size - length)
        try:
            raw = orjson.loads(file.read(length))
            if raw.get("format") != FORMAT:
                raise DeltaError("delta.format", f"must be {FORMAT}, got {raw.get('format')!r}: make the delta again with this version's torchrec-serve delta")
            dense = raw.get("dense")
            header = DeltaHeader(
                model=str(raw["model"]), base=str(raw["base"]), sequence=int(raw["sequence"]),
                created_at=str(raw["created_at"]),
                tables=tuple(TableSection(**t) for t in raw["tables"]),
                dense=None if dense is None else DenseSection(
                    offset=int(dense["offset"]), xxh3_128=str(dense["xxh3_128"]),
                    tensors=tuple(DenseTensor(**{**t, "shape": tuple(t["shape"])}) for t in dense["tensors"]),
                ),
            )
            return header, size - _TRAILER.size - length
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DeltaError("delta.header", f"unreadable: {e}") from None


def read_delta(path: Path, layout: TablesLayout) -> Delta:
    """The delta at ``path``, every section checked against ``layout`` (table, dtype, dim, row
    size), its checksum, and its ids (inside the table, strictly increasing). Raises ``DeltaError``
    naming what is wrong; nothing is applied from a delta that fails."""
    header, header_start = _read_header(path)
    delta = Delta(Path(path), header, np.memmap(path, dtype=np.uint8, mode="r"))
    seen: set[str] = set()
    for section in header.tables:
        field = f"tables.{section.name}"
        table = layout.table(section.name)
        if table is None:
            raise DeltaError(field, "no such table in the served model")
        if section.name in seen:
            raise DeltaError(field, "given twice")
        seen.add(section.name)
        if section.owners != table.raw_ids:
            raise DeltaError(f"{field}.owners", f"is {section.owners}: records of {'a' if table.raw_ids else 'an index'} "
                             f"table {'name' if table.raw_ids else 'do not name'} their slots' raw-id owners")
        for key in ("dtype", "dim", "row_bytes"):
            if getattr(section, key) != getattr(table, key):
                raise DeltaError(f"{field}.{key}", f"is {getattr(section, key)!r}, the served table's is {getattr(table, key)!r}")
        end = section.offset + section.count * section.records.itemsize
        if section.offset < 0 or section.count < 0 or end > header_start:
            raise DeltaError(field, "its rows lie outside the file: truncated")
        records = delta.records(section)
        if xxhash.xxh3_128_hexdigest(records.data) != section.xxh3_128:
            raise DeltaError(f"{field}.xxh3_128", "does not match its rows: the file is damaged")
        ids = records["id"]
        if not _increasing(ids):
            at = int(np.flatnonzero(ids[1:] <= ids[:-1])[0]) + 1
            raise DeltaError(f"{field}.ids", f"must be strictly increasing (sorted, each once): id {int(ids[at])} "
                             f"at position {at} follows {int(ids[at - 1])}")
        if len(ids) and (ids[0] < 0 or ids[-1] >= table.rows):
            bad = int(ids[0] if ids[0] < 0 else ids[-1])
            raise DeltaError(f"{field}.ids", f"id {bad} is outside the table's {table.rows} rows")
        if section.owners:
            _check_owners(records, field)
    if header.dense is not None:
        _check_dense_bytes(delta, header.dense, header_start)
    return delta


def _check_owners(records: np.ndarray, field: str) -> None:
    """A raw-id section's owners: an id owns one slot at most (``MCH_FREE_SLOT`` marks free ones)."""
    owners = np.sort(records["owner"][records["owner"] != MCH_FREE_SLOT])
    twice = np.flatnonzero(owners[1:] == owners[:-1])
    if len(twice):
        raw_id = int(owners[twice[0]])
        slots = records["id"][records["owner"] == raw_id].tolist()
        raise DeltaError(f"{field}.owners", f"raw id {raw_id} is given slots {slots}: an id owns one slot")


def _increasing(ids: np.ndarray) -> bool:
    return bool((ids[1:] > ids[:-1]).all())


def _check_dense_bytes(delta: Delta, section: DenseSection, header_start: int) -> None:
    end = section.offset + section.nbytes
    if section.offset < 0 or end > header_start:
        raise DeltaError("dense", "its tensors lie outside the file: truncated")
    for t in section.tensors:
        dtype = getattr(torch, t.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise DeltaError(f"dense.{t.name}.dtype", f"unknown dtype {t.dtype!r}")
        if math.prod(t.shape) * dtype.itemsize != t.nbytes:
            raise DeltaError(f"dense.{t.name}.nbytes", f"{t.nbytes} bytes do not hold {t.dtype} {list(t.shape)}")
    if xxhash.xxh3_128_hexdigest(delta._data[section.offset : end].data) != section.xxh3_128:
        raise DeltaError("dense.xxh3_128", "does not match its tensors: the file is damaged")


def check_dense(section: DenseSection, served: DenseShapes) -> None:
    """A dense section must give every served dense tensor, as the served artifact holds it (a
    whole-module swap); raises ``DeltaError`` naming the first tensor that does not fit."""
    given = {t.name: t for t in section.tensors}
    for name, (dtype, shape) in served.items():
        t = given.get(name)
        if t is None:
            raise DeltaError(f"dense.{name}", "missing: a dense section gives every dense tensor of the model")
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise DeltaError(f"dense.{name}", f"is {t.dtype} {list(t.shape)}, the served one {dtype} {list(shape)}")
    extra = sorted(set(given) - set(served))
    if extra:
        raise DeltaError(f"dense.{extra[0]}", "no such dense tensor in the served model")
