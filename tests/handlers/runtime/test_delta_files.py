"""Delta files read back and checked; rows written in place into a mapped weights file under the
row lock, never seen torn by a reader of another mapping."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
import xxhash

from handlers.runtime.freshness.applier import (
    AppliedState,
    Pace,
    RowLock,
    TableWriter,
    UndoLog,
    apply_delta,
    write_rows,
)
from handlers.runtime.freshness.config import FreshnessConfig
from handlers.runtime.freshness.delta_file import (
    MAGIC,
    DeltaError,
    DeltaWriter,
    check_dense,
    dense_shapes,
    read_delta,
    read_header,
    record_dtype,
)
from handlers.runtime.freshness.layout import TableLayout, TablesLayout, table_buffers

TABLES = (
    TableLayout("a", "int8", 8, 1000, 12, buffer=0, offset=0),
    TableLayout("b", "fp32", 4, 64, 16, buffer=0, offset=12000),
)
LAYOUT = TablesLayout("f" * 64, TABLES)


def _rows(table: TableLayout, n: int, value: int) -> np.ndarray:
    return np.full((n, table.row_bytes), value, np.uint8)


def _write(path, sequence=1, base=LAYOUT.fingerprint, sections=None):
    sections = sections if sections is not None else [(TABLES[0], np.array([3, 7, 9]), _rows(TABLES[0], 3, 5))]
    with DeltaWriter(path, model="m", base=base, sequence=sequence) as out:
        for table, ids, rows in sections:
            out.add(table, ids, rows)
    return path


def test_a_delta_reads_back_as_written(tmp_path):
    path = _write(tmp_path / "d.delta", sections=[
        (TABLES[0], np.array([3, 7]), _rows(TABLES[0], 2, 5)),
        (TABLES[0], np.array([9]), _rows(TABLES[0], 1, 6)),  # a second chunk of the same table
        (TABLES[1], np.array([0]), _rows(TABLES[1], 1, 7)),
    ])
    delta = read_delta(path, LAYOUT)
    assert (delta.header.model, delta.header.sequence, delta.header.rows) == ("m", 1, 4)
    a, b = (delta.records(s) for s in delta.header.tables)
    assert a["id"].tolist() == [3, 7, 9] and a["row"][:, 0].tolist() == [5, 5, 6]
    assert b["id"].tolist() == [0] and (b["row"] == 7).all()
    assert not (tmp_path / "d.delta.partial").exists()


def _retyped(table: TableLayout, **change) -> TableLayout:
    return TableLayout(**{**table.__dict__, **change})


@pytest.mark.parametrize(
    "sections, field, problem",
    [
        ([(_retyped(TABLES[0], name="zz"), np.array([1]), _rows(TABLES[0], 1, 1))], "tables.zz", "no such table"),
        ([(_retyped(TABLES[0], dim=16), np.array([1]), _rows(TABLES[0], 1, 1))], "tables.a.dim", "is 16"),
        ([(_retyped(TABLES[0], dtype="int4"), np.array([1]), _rows(TABLES[0], 1, 1))], "tables.a.dtype", "int4"),
        ([(TABLES[0], np.array([1000]), _rows(TABLES[0], 1, 1))], "tables.a.ids", "outside the table's 1000 rows"),
    ],
)
def test_a_delta_that_does_not_fit_the_tables_names_the_problem(tmp_path, sections, field, problem):
    path = _write(tmp_path / "d.delta", sections=sections)
    with pytest.raises(DeltaError) as refusal:
        read_delta(path, LAYOUT)
    assert refusal.value.field == field and problem in refusal.value.message


@pytest.mark.parametrize("ids, problem", [([4, 4], "id 4 at position 1 follows 4"), ([7, 3], "id 3 at position 1 follows 7")])
def test_a_delta_whose_ids_are_not_in_order_is_refused(tmp_path, ids, problem):
    """The writer refuses them; a file made some other way is refused when read."""
    with pytest.raises(ValueError, match="strictly increasing"):
        _write(tmp_path / "w.delta", sections=[(TABLES[0], np.array(ids), _rows(TABLES[0], 2, 1))])
    with pytest.raises(ValueError, match="strictly increasing"):  # across chunks too
        _write(tmp_path / "w.delta", sections=[(TABLES[0], np.array(ids[:1]), _rows(TABLES[0], 1, 1)),
                                               (TABLES[0], np.array(ids[1:]), _rows(TABLES[0], 1, 1))])
    path = _with_ids(_write(tmp_path / "d.delta", sections=[(TABLES[0], np.array([1, 2]), _rows(TABLES[0], 2, 1))]), ids)
    with pytest.raises(DeltaError) as refusal:
        read_delta(path, LAYOUT)
    assert refusal.value.field == "tables.a.ids" and problem in refusal.value.message


def _with_ids(path: Path, ids: list[int]) -> Path:
    """The delta with its first table's ids replaced, and its checksum made to match."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[-16:-8], "little")
    header = orjson.loads(bytes(data[-16 - length : -16]))
    section = header["tables"][0]
    kind = record_dtype(section["row_bytes"])
    records = np.frombuffer(data, kind, section["count"], section["offset"]).copy()
    records["id"] = ids
    data[section["offset"] : section["offset"] + records.nbytes] = records.tobytes()
    section["xxh3_128"] = xxhash.xxh3_128_hexdigest(records.tobytes())
    new_header = orjson.dumps(header)
    path.write_bytes(bytes(data[: -16 - length]) + new_header + len(new_header).to_bytes(8, "little") + MAGIC)
    return path


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda d: d[:-3], "truncated"),
        (lambda d: d[:10], "truncated"),
        (lambda d: b"", "truncated"),
        (lambda d: d[:8] + bytes([d[8] ^ 1]) + d[9:], "does not match its rows"),
    ],
)
def test_a_damaged_delta_is_refused(tmp_path, damage, problem):
    path = _write(tmp_path / "d.delta")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DeltaError, match=problem):
        read_delta(path, LAYOUT)


DENSE = {"top.weight": torch.randn(3, 5), "top.bias": torch.randn(3).bfloat16(), "top.q": torch.randint(-9, 9, (2, 2), dtype=torch.int8)}


def _with_dense(path):
    with DeltaWriter(path, model="m", base=LAYOUT.fingerprint, sequence=1) as out:
        out.add(TABLES[0], np.array([3]), _rows(TABLES[0], 1, 5))
        out.add_dense(DENSE)
    return path


def test_dense_weights_read_back_exactly_and_must_fit_the_served_ones(tmp_path):
    delta = read_delta(_with_dense(tmp_path / "d.delta"), LAYOUT)
    read = delta.dense()
    assert list(read) == list(DENSE) and all(torch.equal(read[n], DENSE[n]) for n in DENSE)
    assert delta.records(delta.header.tables[0])["id"].tolist() == [3]
    check_dense(delta.header.dense, dense_shapes(DENSE))
    for served, field in (
        ({**dense_shapes(DENSE), "top.extra": ("float32", (1,))}, "dense.top.extra"),  # one missing
        ({n: v for n, v in dense_shapes(DENSE).items() if n != "top.q"}, "dense.top.q"),  # one unknown
        ({**dense_shapes(DENSE), "top.bias": ("float32", (3,))}, "dense.top.bias"),  # another dtype
        ({**dense_shapes(DENSE), "top.weight": ("float32", (5, 3))}, "dense.top.weight"),  # another shape
    ):
        with pytest.raises(DeltaError) as refused:
            check_dense(delta.header.dense, served)
        assert refused.value.field == field


def test_damaged_dense_weights_are_refused(tmp_path):
    path = _with_dense(tmp_path / "d.delta")
    data = bytearray(path.read_bytes())
    start = read_header(path).dense.offset  # type: ignore[union-attr]
    data[start + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DeltaError, match="dense.xxh3_128"):
        read_delta(path, LAYOUT)


def test_the_header_alone_is_read_without_the_rows(tmp_path):
    header = read_header(_write(tmp_path / "d.delta", sequence=4))
    assert header.sequence == 4 and header.base == LAYOUT.fingerprint and header.tables[0].count == 3


def _weights_file(tmp_path) -> tuple:
    """A weights file like a served archive's, mapped as a worker maps it."""
    buffer = torch.zeros(12000 + 64 * 16, dtype=torch.uint8)
    path = tmp_path / "weights.pt"
    torch.save({"tbe.0": buffer, "dense.w": torch.ones(2)}, path)
    mapped = torch.load(path, mmap=True, weights_only=True)
    return path, mapped, table_buffers(mapped)


def test_rows_written_in_place_are_seen_through_another_mapping(tmp_path):
    path, mapped, buffers = _weights_file(tmp_path)
    delta = read_delta(_write(tmp_path / "d.delta"), LAYOUT)
    state = apply_delta(delta, TableWriter(path, buffers, LAYOUT), RowLock(tmp_path), tmp_path, Pace())
    assert state.sequence == 1 and state.rows_applied == 3 and AppliedState.read(tmp_path) == state
    rows = buffers[0][: 1000 * 12].reshape(1000, 12)  # the reader's own (private) mapping
    assert rows[[3, 7, 9]].eq(5).all() and rows[[0, 4, 8]].eq(0).all()


def test_a_resumed_apply_skips_the_rows_already_written(tmp_path):
    path, _, buffers = _weights_file(tmp_path)
    delta = read_delta(_write(tmp_path / "d.delta"), LAYOUT)
    state = apply_delta(delta, TableWriter(path, buffers, LAYOUT), RowLock(tmp_path), tmp_path,
                        Pace(chunk_rows=1), start_row=2)
    assert state.rows_applied == 1  # only the third row
    assert buffers[0][9 * 12 : 10 * 12].eq(5).all() and buffers[0][3 * 12 : 4 * 12].eq(0).all()


def _table_a(buffers) -> torch.Tensor:
    return buffers[0][: 1000 * 12].reshape(1000, 12)  # as a reader maps it


def _numbered(writer: TableWriter, tmp_path: Path) -> None:
    """Every row of table a its own bytes (row i: i % 256), through the writer."""
    rows = np.repeat((np.arange(1000) % 256).astype(np.uint8)[:, None], 12, axis=1)
    write_rows(read_delta(_write(tmp_path / "numbered.delta", sections=[(TABLES[0], np.arange(1000), rows)]), LAYOUT),
               writer, RowLock(tmp_path), Pace())


def test_the_undo_file_restores_the_rows_a_delta_overwrote(tmp_path):
    path, _, buffers = _weights_file(tmp_path)
    writer, lock = TableWriter(path, buffers, LAYOUT), RowLock(tmp_path)
    _numbered(writer, tmp_path)
    before = _table_a(buffers).clone()
    delta = read_delta(_write(tmp_path / "d.delta"), LAYOUT)
    apply_delta(delta, writer, lock, tmp_path, Pace(chunk_rows=2), undo=tmp_path / "1.undo")
    assert not torch.equal(_table_a(buffers), before)
    undo = read_delta(tmp_path / "1.undo", LAYOUT)
    assert undo.header.sequence == 1 and not (tmp_path / "1.undo.partial").exists()
    apply_delta(undo, writer, lock, tmp_path, Pace())
    assert torch.equal(_table_a(buffers), before)


def test_a_writer_that_dies_after_a_chunk_is_written_and_before_it_is_recorded_keeps_a_whole_undo(tmp_path):
    """The next writer resumes from the recorded row, and keeps the earlier writer's undo rows:
    re-reading the unrecorded chunk's rows would keep their new values as the old."""
    path, _, buffers = _weights_file(tmp_path)
    writer, lock = TableWriter(path, buffers, LAYOUT), RowLock(tmp_path)
    _numbered(writer, tmp_path)
    before = _table_a(buffers).clone()
    delta = read_delta(_write(tmp_path / "d.delta", sections=[(TABLES[0], np.arange(10, 20), _rows(TABLES[0], 10, 200))]), LAYOUT)
    recorded = []

    def dies_at_the_third_chunk(done: int, rows: int) -> None:
        if len(recorded) == 2:
            raise SystemExit("killed")  # the third chunk is written, not recorded
        recorded.append(done)

    with pytest.raises(SystemExit):
        write_rows(delta, writer, lock, Pace(chunk_rows=3), progress=dies_at_the_third_chunk,
                   undo=UndoLog(tmp_path / "1.undo", delta, writer))
    assert recorded == [3, 6] and _table_a(buffers)[16:19].eq(200).all()  # rows 6-8 of the delta: written
    apply_delta(delta, writer, lock, tmp_path, Pace(chunk_rows=3), start_row=recorded[-1], undo=tmp_path / "1.undo")
    assert _table_a(buffers)[10:20].eq(200).all()
    apply_delta(read_delta(tmp_path / "1.undo", LAYOUT), writer, lock, tmp_path, Pace())
    assert torch.equal(_table_a(buffers), before)


def test_an_undo_that_lost_rows_already_written_is_an_error(tmp_path):
    path, _, buffers = _weights_file(tmp_path)
    writer = TableWriter(path, buffers, LAYOUT)
    delta = read_delta(_write(tmp_path / "d.delta"), LAYOUT)
    with pytest.raises(RuntimeError, match="undo is lost"):
        apply_delta(delta, writer, RowLock(tmp_path), tmp_path, Pace(), start_row=2, undo=tmp_path / "1.undo")


def test_no_reader_sees_a_torn_row(tmp_path):
    """A writer flips every row of a wide table (16 KiB rows: copying one is not atomic) between
    all-1 and all-2 bytes, in chunks; readers under the lock, through their own mapping, must
    see each row whole."""
    table = TableLayout("wide", "fp32", 4096, 64, 4 * 4096, buffer=0, offset=0)
    layout = TablesLayout("f" * 64, (table,))
    path = tmp_path / "weights.pt"
    torch.save({"tbe.0": torch.zeros(table.rows * table.row_bytes, dtype=torch.uint8)}, path)
    buffers = table_buffers(torch.load(path, mmap=True, weights_only=True))
    flips = [
        read_delta(_write(tmp_path / f"{v}.delta", sections=[(table, np.arange(table.rows), _rows(table, table.rows, v))]), layout)
        for v in (1, 2)
    ]
    writer = TableWriter(path, buffers, layout)
    rows = buffers[0][: table.rows * table.row_bytes].reshape(table.rows, table.row_bytes)
    stop, torn, reads = threading.Event(), [], [0]

    def read() -> None:
        lock = RowLock(tmp_path)  # a reader's own lock file handle, as another worker has
        while not stop.is_set():
            with lock.reading():
                snapshot = rows.clone()
            mixed = (snapshot != snapshot[:, :1]).any(dim=1)
            if mixed.any():
                torn.append(int(mixed.nonzero()[0]))
            reads[0] += 1

    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in readers:
        thread.start()
    lock = RowLock(tmp_path)
    for i in range(20):
        apply_delta(flips[i % 2], writer, lock, tmp_path, Pace(rows_per_s=float("inf"), chunk_rows=7))
    stop.set()
    for thread in readers:
        thread.join()
    assert reads[0] > 20 and not torn, torn[:5]


def test_the_row_lock_holds_readers_off_while_a_chunk_is_written(tmp_path):
    writer, reader = RowLock(tmp_path), RowLock(tmp_path)  # two open files, as two workers have
    writing, entered = threading.Event(), threading.Event()

    overlapped = []

    def write() -> None:
        with writer.writing():
            writing.set()
            overlapped.append(entered.wait(0.3))  # a reader got in while a chunk was written

    thread = threading.Thread(target=write)
    thread.start()
    writing.wait()
    with reader.reading():
        entered.set()
    thread.join()
    assert overlapped == [False]
    with reader.reading(), RowLock(tmp_path).reading():  # readers share it
        pass


@pytest.mark.parametrize(
    "raw, problem",
    [({"rows_per_s": 0}, "must be positive"), ({"chunk_rows": -1}, "must be positive"), ({"speed": 1}, "unknown keys")],
)
def test_a_bad_freshness_section_in_the_model_config_names_the_key(raw, problem):
    with pytest.raises(ValueError, match=problem):
        FreshnessConfig.from_mapping(raw)
    assert FreshnessConfig.from_mapping(None) == FreshnessConfig()
    config = FreshnessConfig.from_mapping({"rows_per_s": 10, "tables_dir": "/big/tmpfs"})
    assert config.pace.rows_per_s == 10 and config.tables_roots[0] == Path("/big/tmpfs")


def test_an_earlier_writers_undo_is_kept_only_as_far_as_its_ids_are_the_deltas(tmp_path):
    """A partial undo whose fourth record is not the delta's fourth row (a log folder changed
    under the writer): its first three rows are kept, the rest is not trusted. A writer that had
    written four rows cannot resume on it; one that had written three completes it."""
    path, _, buffers = _weights_file(tmp_path)
    writer = TableWriter(path, buffers, LAYOUT)
    _numbered(writer, tmp_path)
    delta = read_delta(_write(tmp_path / "d.delta", sections=[(TABLES[0], np.arange(10, 20), _rows(TABLES[0], 10, 200))]), LAYOUT)
    earlier = np.zeros(4, record_dtype(TABLES[0].row_bytes))
    earlier["id"] = [10, 11, 12, 99]
    earlier["row"] = 7  # what the earlier writer read as the old rows
    (tmp_path / "1.undo.partial").write_bytes(earlier.tobytes())
    with pytest.raises(RuntimeError, match="holds the old values of 3 rows .* but 4 are written already"):
        apply_delta(delta, writer, RowLock(tmp_path), tmp_path, Pace(), start_row=4, undo=tmp_path / "1.undo")
    apply_delta(delta, writer, RowLock(tmp_path), tmp_path, Pace(), start_row=3, undo=tmp_path / "1.undo")
    undo = read_delta(tmp_path / "1.undo", LAYOUT).records(delta.header.tables[0])
    assert undo["id"].tolist() == list(range(10, 20))
    assert (undo["row"][:3] == 7).all() and undo["row"][3:, 0].tolist() == list(range(13, 20))
