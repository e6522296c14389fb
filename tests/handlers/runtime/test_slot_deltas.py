"""Deltas of raw-id tables: slot maps rebuilt from new owners, records that name each slot's
owner, and owners written with their rows into a mapped weights file under the row lock, never
seen torn by a reader of another mapping, undone with their rows, copied again from the staged
map after a writer died; a delta that would give an id two slots refused at publish."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from handlers.modeling.raw_ids import served_remap
from handlers.modeling.spec import TableSpec
from handlers.runtime.freshness.applier import Pace, RowLock, TableWriter, apply_delta, write_rows
from handlers.runtime.freshness.delta_file import DeltaError, DeltaWriter, read_delta
from handlers.runtime.freshness.layout import TableLayout, TablesLayout, table_buffers
from handlers.runtime.freshness import follower as follower_module
from handlers.runtime.freshness.applier import AppliedState
from handlers.runtime.freshness.follower import LogFollower
from handlers.runtime.freshness.log import mark_rollback
from handlers.runtime.archive_files import LOG_POINTER
from handlers.runtime.freshness.protocol import PROTOCOL, reply_bytes
from handlers.runtime.freshness.shared_tables import SharedTables
from handlers.runtime.freshness.slot_writes import StagedMap, check_owners, stage
from handlers.runtime.freshness.worker import WorkerFreshness
from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT
from handlers.runtime.slot_maps import hash_map, owners_of, slot_map, slot_maps_in, with_owners

ROWS = 64
RAW = TableLayout("r", "fp32", 4, ROWS, 16, buffer=0, offset=0, raw_ids=True)
INDEX = TableLayout("i", "fp32", 4, ROWS, 16, buffer=0, offset=ROWS * 16)
LAYOUT = TablesLayout("f" * 64, (RAW, INDEX))
# slot k owned by raw id 1000 * k - 7 (negative, positive, unordered), the last slot free
OWNERS = torch.tensor([(1000 * k - 7) * (-1) ** k for k in range(ROWS - 1)] + [MCH_FREE_SLOT])


def _row_bytes(values) -> np.ndarray:
    """fp32 rows [n, 4] as the table holds them, uint8 [n, 16]."""
    return np.asarray(values, np.float32).reshape(-1, 4).view(np.uint8)


def test_a_slot_map_rebuilt_from_new_owners_is_the_map_of_those_owners():
    current = slot_map(OWNERS)
    assert torch.equal(owners_of(current), OWNERS)
    slots, owners = torch.tensor([0, 5, ROWS - 1]), torch.tensor([77, MCH_FREE_SLOT, -(2**63)])
    expected = OWNERS.clone()
    expected[slots] = owners
    for got, want in zip(with_owners(owners_of(current), slots, owners, hashed=False), slot_map(expected)):
        assert torch.equal(got, want)
    (identities,) = with_owners(owners_of(hash_map(OWNERS)), slots, owners, hashed=True)  # ZCH: row-aligned
    assert identities[5] == ZCH_EMPTY_SLOT and torch.equal(owners_of((identities,)), expected)
    for hashed in (False, True):
        with pytest.raises(ValueError, match=r"raw id -993 would own slots \[1, 2\]"):  # slot 1's owner given slot 2 too
            with_owners(OWNERS.clone(), torch.tensor([2]), OWNERS[1:2], hashed)


def test_slot_maps_are_found_by_table_beside_a_graphs_constants_and_a_half_map_is_refused():
    ids, slots = slot_map(OWNERS)
    (identities,) = hash_map(OWNERS)
    compiled = {"slot_maps.r.sorted_ids": ids, "slot_maps.r.slots": slots, "slot_maps.z.identities": identities,
                "tbe.0": ids, "model.sparse.raw_id_remaps.sorted_ids": ids, "model.sparse.raw_id_remaps.slots": slots,
                "model.sparse.raw_id_remaps.identities": identities,
                "model.sparse.raw_id_remaps.counts": torch.zeros((2, 2), dtype=torch.int64)}
    found = slot_maps_in(compiled)
    assert set(found) == {"r", "z"} and torch.equal(found["r"][1], slots) and torch.equal(found["z"][0], identities)
    with pytest.raises(ValueError, match=r"tables \['r'\] hold neither sorted_ids and slots nor identities alone"):
        slot_maps_in({"slot_maps.r.slots": slots})
    with pytest.raises(ValueError, match=r"tables \['r'\] hold neither"):
        slot_maps_in({"slot_maps.r.slots": slots, "slot_maps.r.sorted_ids": ids, "slot_maps.r.identities": ids})


def _delta(path, records: dict[str, tuple], sequence: int = 1, layout: TablesLayout = LAYOUT):
    with DeltaWriter(path, model="m", base=layout.fingerprint, sequence=sequence) as out:
        for name, (ids, rows, owners) in records.items():
            out.add(layout.table(name), np.array(ids), rows, None if owners is None else np.array(owners))
    return path


def test_a_raw_id_tables_records_carry_owners_and_only_its_do(tmp_path):
    path = _delta(tmp_path / "d.delta", {"r": ([2, 9], _row_bytes(np.ones(8)), [5, MCH_FREE_SLOT]),
                                         "i": ([3], _row_bytes(np.ones(4)), None)})
    delta = read_delta(path, LAYOUT)
    raw, index = (delta.records(s) for s in delta.header.tables)
    assert raw["owner"].tolist() == [5, MCH_FREE_SLOT] and raw["id"].tolist() == [2, 9]
    assert "owner" not in index.dtype.names
    with pytest.raises(ValueError, match="table r: its records need owners"):
        _delta(tmp_path / "x.delta", {"r": ([2], _row_bytes(np.ones(4)), None)})
    with pytest.raises(ValueError, match="table i: its records take no owners"):
        _delta(tmp_path / "x.delta", {"i": ([2], _row_bytes(np.ones(4)), [5])})


@pytest.mark.parametrize("served, owners, field, problem", [
    (TablesLayout("f" * 64, (RAW.__class__(**{**RAW.__dict__, "raw_ids": False}), INDEX)), [5, 6],
     "tables.r.owners", "do not name their slots' raw-id owners"),
    (LAYOUT, [5, 5], "tables.r.owners", "raw id 5 is given slots [2, 9]"),
])
def test_a_raw_id_section_that_does_not_fit_is_refused_naming_the_field(tmp_path, served, owners, field, problem):
    path = _delta(tmp_path / "d.delta", {"r": ([2, 9], _row_bytes(np.ones(8)), owners)})
    with pytest.raises(DeltaError) as refused:
        read_delta(path, served)
    assert refused.value.field == field and problem in refused.value.message


def _served(slot_map):
    """MCH table r's served remap on ``slot_map``: ids int64 [n] -> slots int64 [n]."""
    remap = served_remap(TableSpec(name="r", rows=ROWS, dim=4, features=["f"], ids="raw", remap={"kind": "mch"}))
    remap.load({"r": slot_map})
    return remap.first_feature


def _weights_file(tmp_path):
    """A weights file with a raw-id table and its slot map, mapped as a worker maps it: (path,
    the mapped tensors, a writer of the file)."""
    path = tmp_path / "weights.pt"
    ids, slots = slot_map(OWNERS)
    rows = torch.arange(2 * ROWS * 4, dtype=torch.float32).reshape(2 * ROWS, 4)
    torch.save({"tbe.0": rows.reshape(-1).view(torch.uint8), "slot_maps.r.sorted_ids": ids, "slot_maps.r.slots": slots}, path)
    mapped = torch.load(path, mmap=True, weights_only=True)
    return path, mapped, TableWriter(path, table_buffers(mapped), LAYOUT, slot_maps_in(mapped))


def test_owners_and_rows_written_in_place_are_seen_through_another_mapping_and_undone_together(tmp_path):
    path, mapped, writer = _weights_file(tmp_path)
    before = {k: v.clone() for k, v in mapped.items()}
    # id OWNERS[3] is evicted: slot 3 goes to a new id with a new row; slot 63 (free) is taken
    delta = read_delta(_delta(tmp_path / "d.delta", {"r": ([3, ROWS - 1], _row_bytes(-np.ones(8)), [123, -456])}), LAYOUT)
    apply_delta(delta, writer, RowLock(tmp_path), tmp_path, Pace(), undo=tmp_path / "d.undo")
    remap = _served((mapped["slot_maps.r.sorted_ids"], mapped["slot_maps.r.slots"]))  # the reader's own mapping
    assert remap(torch.tensor([123, -456, int(OWNERS[3]), int(OWNERS[4])])).tolist() == [3, ROWS - 1, ROWS - 1, 4]
    rows = mapped["tbe.0"].view(torch.float32).reshape(2 * ROWS, 4)
    assert rows[3].tolist() == [-1.0] * 4 and rows[4].tolist() == before["tbe.0"].view(torch.float32)[16:20].tolist()
    write_rows(read_delta(tmp_path / "d.undo", LAYOUT), writer, RowLock(tmp_path), Pace())
    assert all(torch.equal(mapped[k], before[k]) for k in before)


def test_a_zch_tables_owners_are_written_at_their_slots_alone_and_a_dead_writers_copy_is_redone(tmp_path):
    """ZCH's identities are row-aligned: the staged entries are the moved slots' own, written
    with their rows in one hold; a writer that died copying them is followed by one that copies
    them again; undone together."""
    path = tmp_path / "weights.pt"
    rows = torch.arange(2 * ROWS * 4, dtype=torch.float32).reshape(2 * ROWS, 4)
    (identities,) = hash_map(OWNERS)
    torch.save({"tbe.0": rows.reshape(-1).view(torch.uint8), "slot_maps.r.identities": identities}, path)
    mapped = torch.load(path, mmap=True, weights_only=True)
    writer = TableWriter(path, table_buffers(mapped), LAYOUT, slot_maps_in(mapped))
    before = {k: v.clone() for k, v in mapped.items()}
    delta = read_delta(_delta(tmp_path / "00000001.delta", {"r": ([3, 7, ROWS - 1], _row_bytes(-np.ones(12)),
                                                                   [123, int(OWNERS[7]), -456])}), LAYOUT)
    section = delta.header.tables[0]
    staged = stage(writer, "r", delta.records(section), key=f"{delta.path.name}:{section.xxh3_128}")
    assert staged.scattered and staged.moved.tolist() == [3, ROWS - 1] and staged.parts[0].tolist() == [123, -456]
    seen = mapped["slot_maps.r.identities"]  # the reader's own mapping
    expected = before["slot_maps.r.identities"].clone()
    expected[[3, ROWS - 1]] = torch.tensor([123, -456])
    apply_delta(delta, writer, RowLock(tmp_path), tmp_path, Pace(), undo=tmp_path / "d.undo")
    assert torch.equal(seen, expected)
    assert mapped["tbe.0"].view(torch.float32).reshape(2 * ROWS, 4)[[3, 7, ROWS - 1]].eq(-1).all()
    write_rows(read_delta(tmp_path / "d.undo", LAYOUT), writer, RowLock(tmp_path), Pace())
    assert all(torch.equal(mapped[k], before[k]) for k in before)
    staged.save(tmp_path / "staged-map-r.pt")
    writer.slot_map("r")[0][3] = 0  # what a writer that died midway left (its staged entries kept)
    apply_delta(delta, writer, RowLock(tmp_path), tmp_path, Pace())
    assert torch.equal(seen, expected)
    marker = read_delta(_delta(tmp_path / "00000002.delta", {"r": ([5], _row_bytes(-np.ones(4)), [ZCH_EMPTY_SLOT])},
                               sequence=2), LAYOUT)
    with pytest.raises(DeltaError, match="raw id -1 marks an empty slot of a zch table") as refused:
        stage(writer, "r", marker.records(marker.header.tables[0]), key="marker")
    assert refused.value.field == "tables.r.owners"


def test_no_reader_sees_an_id_with_another_ids_row(tmp_path):
    """Torn-pair probe: ids A and B swap slots 10 and 20, each taking its own row along, delta
    after delta, while a reader maps A under the row lock and reads its row: always A's."""
    path, mapped, writer = _weights_file(tmp_path)
    a, b = int(OWNERS[10]), int(OWNERS[20])
    rows = {a: _row_bytes(np.full(4, 1.0)), b: _row_bytes(np.full(4, 2.0))}
    deltas = [
        read_delta(_delta(tmp_path / f"{k}.delta", {"r": ([10, 20], np.concatenate([rows[x], rows[y]]), [x, y])}), LAYOUT)
        for k, (x, y) in enumerate(((a, b), (b, a)))
    ]
    remap = _served((mapped["slot_maps.r.sorted_ids"], mapped["slot_maps.r.slots"]))
    table = mapped["tbe.0"].view(torch.float32).reshape(2 * ROWS, 4)
    lock, stop, seen = RowLock(tmp_path), threading.Event(), []
    writing = RowLock(tmp_path)  # the writer's own open file: excludes the reader's
    write_rows(deltas[0], writer, writing, Pace())  # A's row is 1.0 from here on

    def read() -> None:
        while not stop.is_set():
            with lock.reading():
                seen.append(float(table[int(remap(torch.tensor([a])))][0]))

    reader = threading.Thread(target=read)
    reader.start()
    for k in range(1, 201):
        write_rows(deltas[k % 2], writer, writing, Pace(rows_per_s=1e9))
    stop.set()
    reader.join()
    torn = [v for v in seen if v != 1.0]
    assert len(seen) > 100 and not torn, (len(seen), torn[:5])


def test_a_writer_that_died_copying_a_map_is_followed_by_one_that_copies_the_staged_map_again(tmp_path):
    """The slots that change owner go in with the map; a slot that keeps its owner takes its new
    row in a chunk of its own. A map whose changed span was left half copied (zeroed here) is not
    rebuilt from: the staged span is copied again."""
    path, _, writer = _weights_file(tmp_path)
    records = {"r": ([3, 4, 7], _row_bytes(-np.ones(12)), [123, int(OWNERS[4]), int(OWNERS[7])])}  # slot 3 evicted
    delta = read_delta(_delta(tmp_path / "00000001.delta", records), LAYOUT)
    section = delta.header.tables[0]
    staged = stage(writer, "r", delta.records(section), key=f"{delta.path.name}:{section.xxh3_128}")
    assert staged.moved.tolist() == [3]
    staged.save(tmp_path / "staged-map-r.pt")
    assert StagedMap.load(tmp_path / "staged-map-r.pt", key="another delta's") is None
    writer.slot_map("r")[0][staged.start : staged.start + staged.length] = 0  # what the dead writer left
    apply_delta(delta, writer, RowLock(tmp_path), tmp_path, Pace())
    expected = OWNERS.clone()
    expected[3] = 123
    assert torch.equal(owners_of(writer.slot_map("r")), expected)
    rows = torch.load(path, weights_only=True)["tbe.0"].view(torch.float32).reshape(2 * ROWS, 4)
    assert rows[[3, 4, 7]].eq(-1).all() and not (tmp_path / "staged-map-r.pt").exists()
    empty = read_delta(_delta(tmp_path / "00000002.delta", {"r": ([], np.zeros((0, 16), np.uint8), [])}, sequence=2), LAYOUT)
    apply_delta(empty, writer, RowLock(tmp_path), tmp_path, Pace())  # a raw-id section of no records


def test_a_delta_that_would_give_an_id_two_slots_is_refused_at_publish(tmp_path):
    """Against the served map, and the pending deltas of the log as they will leave it."""
    _, _, writer = _weights_file(tmp_path)

    def delta(name: str, slots: list[int], owners: list[int]):
        return read_delta(_delta(tmp_path / name, {"r": (slots, _row_bytes(np.ones(4 * len(slots))), owners)}), LAYOUT)

    taken = delta("taken.delta", [5], [int(OWNERS[3])])  # OWNERS[3] keeps slot 3
    with pytest.raises(DeltaError) as refused:
        check_owners(writer, taken, pending=[])
    assert refused.value.field == "tables.r.owners"
    assert f"gives raw id {int(OWNERS[3])} slot 5 while it keeps slot 3" in refused.value.message
    check_owners(writer, taken, pending=[delta("frees.delta", [3], [77])])  # a pending delta gives slot 3 away
    check_owners(writer, delta("moves.delta", [3, 5], [int(OWNERS[5]), int(OWNERS[3])]), pending=[])  # a swap
    with pytest.raises(DeltaError, match=r"gives raw id 88 slot 9 while it keeps slot 8"):
        check_owners(writer, delta("twice.delta", [9], [88]), pending=[delta("pending.delta", [8], [88])])


def test_a_rollback_cut_short_after_an_undo_goes_on_from_the_next(tmp_path, monkeypatch):
    """Delta 1 gives slot 0 to X and X's old owner A slot 1; delta 2 gives slot 1 to Y. Undone
    newest first, the writer dies right after undoing delta 1: the next one must not undo delta 2
    again (A would own slots 0 and 1), and ends with the archive's owners."""
    _, _, writer = _weights_file(tmp_path)
    with pytest.raises(ValueError, match="have no slot map"):
        TableWriter(tmp_path / "weights.pt", [writer.slot_map("r")[0].view(torch.uint8)], LAYOUT)
    a = int(OWNERS[0])
    log = tmp_path / "log"
    log.mkdir()
    _delta(log / "00000001.delta", {"r": ([0, 1], _row_bytes(np.ones(8)), [77, a])})
    _delta(log / "00000002.delta", {"r": ([1], _row_bytes(np.ones(4)), [88])}, sequence=2)
    follower = LogFollower(tmp_path, LAYOUT, writer, RowLock(tmp_path), Pace())
    follower.catch_up(log, Pace())
    assert AppliedState.read(tmp_path).sequence == 2
    mark_rollback(log, 0, 2)
    real, calls = follower_module.write_rows, []

    def dies_after_the_second_undo(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed")

    monkeypatch.setattr(follower_module, "write_rows", dies_after_the_second_undo)
    with pytest.raises(RuntimeError, match="killed"):
        follower.catch_up(log, Pace())
    monkeypatch.setattr(follower_module, "write_rows", real)
    follower.catch_up(log, Pace())
    assert AppliedState.read(tmp_path).sequence == 0
    assert torch.equal(owners_of(writer.slot_map("r")), OWNERS)


def test_a_publish_through_the_workers_call_is_checked_against_the_log_s_pending_deltas(tmp_path):
    """The plugin's check call (what ``POST /freshness`` asks a worker before it logs a delta):
    a 409 while the worker is still loading its tables, then a 400 naming ``tables.r.owners``
    for a delta that gives a kept id a second slot, unless a delta already in the log, not yet
    applied, gives that slot away."""
    path, _, writer = _weights_file(tmp_path)
    log = tmp_path / "log"
    log.mkdir()
    (tmp_path / LOG_POINTER).write_bytes(orjson.dumps({"log": str(log)}))
    freshness = WorkerFreshness(tmp_path, SharedTables(tmp_path, path, hold=-1), LAYOUT, Pace())
    freshness.dense = "no dense weights to follow"

    def check(delta: Path) -> dict:
        call = orjson.dumps({"protocol": PROTOCOL, "op": "check", "delta": str(delta)})
        return orjson.loads(reply_bytes(call, freshness.answer))

    def delta(name: str, sequence: int, slots: list[int], owners: list[int]) -> Path:
        records = {"r": (slots, _row_bytes(np.ones(4 * len(slots))), owners)}
        return _delta(tmp_path / name, records, sequence=sequence)

    loading = check(delta("taken.delta", 1, [5], [int(OWNERS[3])]))  # its slot maps are not mapped yet
    assert loading["status"] == 409 and "still loading" in loading["error"]["message"], loading
    freshness.follower = LogFollower(tmp_path, LAYOUT, writer, freshness.lock, Pace())
    taken = check(tmp_path / "taken.delta")  # OWNERS[3] keeps slot 3
    assert taken["status"] == 400 and taken["error"]["field"] == "tables.r.owners", taken
    (log / "00000001.delta").write_bytes(delta("frees.delta", 1, [3], [77]).read_bytes())  # logged, not applied
    assert check(delta("then.delta", 2, [5], [int(OWNERS[3])]))["status"] == 200
