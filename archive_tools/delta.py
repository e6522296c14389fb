"""``torchrec-serve delta``: the rows of a served model's tables that a newer checkpoint changed,
quantized exactly as a fresh build would quantize them, and optionally the dense part's new
weights in the form the archive serves them, written as one delta file.

    make_delta(archive, DeltaSource(checkpoint=Path("trained-2.pt")), out, sequence=1)
        # refused if trained-2.pt's dense weights differ from the archive's: add dense=Path("trained-2.pt")
        # to carry them, or rows_only=True to leave them out (archive_tools.delta_dense compares them)
    make_delta(archive, DeltaSource(rows=Path("touched.pt")), out, sequence=2)
        # touched.pt: {"cat_0": {"ids": int64 [n], "rows": float [n, dim]}, ...}
    make_delta(archive, DeltaSource(dense=Path("trained-3.pt")), out, sequence=3)  # dense only

From a checkpoint, every row is quantized in chunks and compared with the archive's own bytes: only
rows whose served bytes differ go into the delta, and no table is held twice in memory. Row-wise
quantization (an fp16 scale and bias per row) makes a row's bytes depend on that row alone, so a
changed row is byte-identical to what a full build from the checkpoint holds (``verify_delta``).
A raw-id table's records are the slots whose owner or row changed (evictions, insertions, trained
rows), each with its new owner: the checkpoint's managed-collision state against the archive's
slot map.
"""

from __future__ import annotations

import contextlib
import pickle
import dataclasses
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from archive_tools.delta_dense import dense_changes, refusal, served_dense, verify_dense
from handlers.modeling import pruning, raw_ids
from handlers.modeling.checkpoint import read_checkpoint
from handlers.modeling.embedding_modules import table_weights
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import archive_spec
from handlers.modeling.row_formats import encode_rows
from handlers.modeling.spec import ModelSpec
from handlers.runtime.archive import Archive, tables_file_name
from handlers.runtime.archive_files import TABLES, WEIGHTS
from handlers.runtime.errors import InputError
from handlers.runtime.freshness.delta_file import DeltaWriter, read_delta
from handlers.runtime.freshness.layout import TableLayout, TablesLayout, table_buffers
from handlers.runtime.slot_maps import owners_of, slot_maps_in

CHUNK_ROWS = 1 << 18


@dataclasses.dataclass(frozen=True)
class DeltaSource:
    """Where the new rows come from: a trained checkpoint (the same names ``build`` takes), or a
    file of changed rows per table (``{table: {"ids": int64 [n], "rows": float [n, dim]}}``, the ids
    in any order, each once), or neither; ``dense``: a checkpoint (whole, or its dense weights
    alone) whose dense weights the delta carries, to be swapped in whole; ``rows_only``: a
    checkpoint's dense change is meant to be left out (without it or ``dense``, a checkpoint whose
    dense weights differ from the archive's is refused)."""

    checkpoint: Path | None = None
    rows: Path | None = None
    dense: Path | None = None
    rows_only: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint is not None and self.rows is not None:
            raise InputError("table rows come from a checkpoint or from a rows file, not both")
        if self.rows_only and (self.dense is not None or self.checkpoint is None):
            raise InputError("--rows-only leaves a checkpoint's dense change out: it goes with --checkpoint, not --dense")
        if self.checkpoint is None and self.rows is None and self.dense is None:
            raise InputError("a delta needs a checkpoint, a rows file or dense weights")


@dataclasses.dataclass(frozen=True)
class DeltaSummary:
    """``moved_by_table``: of a raw-id table's rows, the slots that change owner."""

    path: Path
    rows_by_table: dict[str, int]
    bytes: int
    dense_tensors: int = 0
    moved_by_table: dict[str, int] = dataclasses.field(default_factory=dict)


def served_rows(floats: torch.Tensor, table: TableLayout) -> np.ndarray:
    """Float rows [n, dim] -> their bytes as the table holds them (``row_formats.encode_rows``),
    uint8 [n, row_bytes] with zero padding to the row size."""
    packed = encode_rows(floats, table.dtype)
    out = np.zeros((floats.shape[0], table.row_bytes), np.uint8)
    out[:, : packed.shape[1]] = packed.numpy()
    return out


def table_rows(buffer: torch.Tensor, table: TableLayout) -> np.ndarray:
    """The table's rows in a TBE buffer, uint8 [rows, row_bytes] (a view)."""
    flat = buffer.numpy()
    return flat[table.offset : table.offset + table.rows * table.row_bytes].reshape(table.rows, table.row_bytes)


def make_delta(archive: Path, source: DeltaSource, out: Path, sequence: int, name: str | None = None) -> DeltaSummary:
    """Writes the delta for ``archive``'s model at ``out`` (one pass, progress on stderr); refuses
    (``InputError``, naming the modules) a checkpoint whose dense weights differ from the
    archive's unless ``source`` says to carry them or to leave them out."""
    with _base(archive) as base:
        rows: dict[str, int] = {}
        moved: dict[str, int] = {}
        if source.checkpoint and not (source.dense or source.rows_only):
            changes = dense_changes(base.archive, base.spec, read_checkpoint(source.checkpoint))
            if changes:
                raise InputError(refusal(changes, source.checkpoint))
        dense = served_dense(base.archive, base.spec, read_checkpoint(source.dense)) if source.dense else {}
        with DeltaWriter(out, model=name or base.spec.name, base=base.layout.fingerprint, sequence=sequence) as writer:
            if source.checkpoint:
                changes = _from_checkpoint(base, source.checkpoint)
            else:
                changes = _from_rows(base, source.rows) if source.rows else iter(())
            for table, ids, data, owners in changes:
                if len(ids):
                    writer.add(table, ids, data, owners)
                    rows[table.name] = rows.get(table.name, 0) + len(ids)
                    if owners is not None:
                        moved[table.name] = moved.get(table.name, 0) + int((base.owners[table.name][ids] != owners).sum())
            if dense:
                writer.add_dense(dense)
    return DeltaSummary(Path(out), rows, Path(out).stat().st_size, len(dense), moved)


def verify_delta(archive: Path, delta_path: Path, checkpoint: Path, rows_only: bool = False) -> list[str]:
    """What the archive serves with the delta applied, against a fresh build from ``checkpoint``
    (TorchRec's whole-table quantization, as ``build`` runs it): its rows, slot owners and, unless
    ``rows_only`` (the delta leaves a dense change out), dense weights (the delta's, or the
    archive's where it has none, as served). The tables and dense modules that differ (empty:
    identical)."""
    with _base(archive) as base, tempfile.TemporaryDirectory(prefix="delta-verify-") as tmp:
        delta = read_delta(delta_path, base.layout)
        factory = DLRMFactory(base.spec)
        model = factory.float_model(seed=0)
        trained = read_checkpoint(checkpoint)
        factory.load_checkpoint(model, trained)
        fresh_file = Path(tmp) / WEIGHTS
        factory.save_weights(factory.quantize(model), fresh_file)
        fresh_weights = torch.load(fresh_file, mmap=True, weights_only=True)
        fresh, fresh_maps = table_buffers(fresh_weights), slot_maps_in(fresh_weights)
        differing = []
        for table in base.layout.tables:
            current = table_rows(base.buffers[table.buffer], table).copy()
            owners = base.owners[table.name].copy() if table.raw_ids else None
            section = next((s for s in delta.header.tables if s.name == table.name), None)
            if section is not None:
                records = delta.records(section)
                current[records["id"]] = records["row"]
                if owners is not None:
                    owners[records["id"]] = records["owner"]
            same_owners = owners is None or np.array_equal(owners, owners_of(fresh_maps[table.name]).numpy())
            if not (same_owners and np.array_equal(current, table_rows(fresh[table.buffer], table))):
                differing.append(table.name)
        if not rows_only:
            carried = delta.dense() if delta.header.dense is not None else None
            differing += verify_dense(base.archive, base.spec, carried, trained)
        return differing


@dataclasses.dataclass
class _Base:
    """What a delta is made against: the archive, its spec, its table layout, its table
    buffers (mapped from the file that holds them) and its raw-id tables' slot owners
    (int64 [rows] each, row-aligned)."""

    archive: Archive
    spec: ModelSpec
    layout: TablesLayout
    buffers: list[torch.Tensor]
    owners: dict[str, np.ndarray]


@contextlib.contextmanager
def _base(path: Path) -> Iterator[_Base]:
    with Archive.open(path) as archive:
        layout = archive.layout
        if layout is None:
            why = tables_file_name(archive.options)[1] or f"no {TABLES}; rebuild it with this version"
            raise InputError(f"{path}: cannot take deltas: {why}")
        spec = archive_spec(archive)
        unmarked = sorted(set(spec.raw_id_tables) - {t.name for t in layout.tables if t.raw_ids})
        if unmarked:  # built before deltas moved slots: its layout does not say which tables take raw ids
            raise InputError(f"{path}: its {TABLES} does not mark raw-id tables {unmarked}; rebuild it with this version")
        weights = torch.load(archive.tables_file(), mmap=True, weights_only=True)
        buffers = table_buffers(weights, layout.buffer_constants)
        owners = {name: owners_of(m).numpy() for name, m in slot_maps_in(weights).items()}
        yield _Base(archive, spec, layout, buffers, owners)


# (table, row ids [n], their served bytes [n, row_bytes], a raw-id table's slot owners [n] or None)
Changes = Iterator[tuple[TableLayout, np.ndarray, np.ndarray, "np.ndarray | None"]]


def _from_checkpoint(base: _Base, checkpoint: Path) -> Changes:
    """Rows whose served bytes differ between the archive and ``checkpoint``, and a raw-id
    table's slots whose owner differs; a pruned table's rows are those of its kept ids (a pruned
    id's new row is not served, so not sent)."""
    factory = DLRMFactory(base.spec)
    model = factory.float_model(seed=0)
    factory.load_checkpoint(model, read_checkpoint(checkpoint))
    weights = table_weights(model)
    new_owners = {name: owners.numpy() for name, owners in raw_ids.slot_owners(model).items()}
    with tqdm(total=sum(t.rows for t in base.layout.tables), desc="delta", unit="row", unit_scale=True) as bar:
        for table in base.layout.tables:
            old = table_rows(base.buffers[table.buffer], table)
            kept = factory.kept.get(table.name)
            for start in range(0, table.rows, CHUNK_ROWS):
                end = min(table.rows, start + CHUNK_ROWS)
                floats = weights[table.name]
                new = served_rows(floats[start:end] if kept is None else floats[kept[start:end]], table)
                differ = (new != old[start:end]).any(axis=1)
                owners = new_owners[table.name][start:end] if table.raw_ids else None
                if owners is not None:
                    differ |= owners != base.owners[table.name][start:end]
                changed = np.flatnonzero(differ)
                yield table, changed + start, new[changed], None if owners is None else owners[changed]
                bar.update(end - start)


def read_rows_file(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A rows file, ``{table: {"ids": int64 [n], "rows": float [n, dim]}}``; anything else is
    refused naming the file."""
    try:
        given = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:  # not a torch file, or not plain tensors
        raise InputError(f"{path}: not a rows file torch can load: {str(e).splitlines()[0]}") from None
    if not isinstance(given, dict) or not all(isinstance(e, dict) and {"ids", "rows"} <= set(e) for e in given.values()):
        raise InputError(f"{path}: must map each table's name to {{'ids': int64 [n], 'rows': float [n, dim]}}")
    return given


def _from_rows(base: _Base, path: Path) -> Changes:
    """The rows file's rows, by id; a pruned table's ids become their rows, and a pruned id is
    refused (it has no row to update)."""
    given = read_rows_file(path)
    kept_ids = pruning.kept_ids(base.spec)
    ids_of = {t.name: t.rows for t in base.spec.tables}
    for name, entry in given.items():
        table = base.layout.table(name)
        if table is None:
            raise InputError(f"{path}: no table {name!r} in the model; it has {[t.name for t in base.layout.tables]}")
        if table.raw_ids:
            raise InputError(f"{path}: table {name} takes raw ids: its rows move between ids as training assigns "
                             "slots, so its delta comes from a checkpoint (--checkpoint), slot owners with rows")
        ids, floats = torch.as_tensor(entry["ids"], dtype=torch.int64), torch.as_tensor(entry["rows"])
        if floats.shape != (len(ids), table.dim):
            raise InputError(f"{path}: {name}.rows must be [{len(ids)}, {table.dim}], got {list(floats.shape)}")
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= ids_of[name]):
            raise InputError(f"{path}: {name}.ids must lie in 0..{ids_of[name] - 1}")
        ids, order = torch.sort(ids)  # a delta's ids are in order
        repeated = torch.nonzero(ids[1:] == ids[:-1]).flatten()
        if len(repeated):
            raise InputError(f"{path}: {name}.ids gives id {int(ids[repeated[0]])} more than once")
        if name in kept_ids:
            rows, found = pruning.rows_of(ids, kept_ids[name])
            if not bool(found.all()):
                pruned = int(ids[~found][0])
                raise InputError(
                    f"{path}: {name}.ids: id {pruned} was pruned from table {name} (it serves "
                    f"{table.rows} of its {ids_of[name]} ids): a pruned id has no row to update; plan and "
                    "build again to serve it"
                )
            ids = rows
        for start in range(0, len(ids), CHUNK_ROWS):
            chunk = slice(start, start + CHUNK_ROWS)
            yield table, ids[chunk].numpy(), served_rows(floats[order[chunk]], table), None
