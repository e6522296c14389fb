"""A worker's answers to the plugin's freshness calls, the writer's rollbacks, and how its
threads go on past errors (a bad mailbox, a log entry that cannot be applied), on delta logs made
here."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from handlers.modeling.raw_ids import random_slot_map, served_remap
from handlers.modeling.spec import TableSpec
from handlers.runtime.archive_files import LOG_POINTER
from handlers.runtime.freshness.applier import AppliedState, Pace, TableWriter
from handlers.runtime.freshness.follower import LogFollower
from handlers.runtime.freshness.log import ROLLBACK_MARK, mark_rollback
from handlers.runtime.freshness.protocol import PROTOCOL, reply_bytes
from handlers.runtime.freshness.shared_tables import SharedTables
from handlers.runtime.freshness import worker
from handlers.runtime.freshness.worker import WorkerFreshness
from handlers.runtime.id_buckets import index_of
from tests.handlers.runtime.test_delta_files import LAYOUT, TABLES, _rows, _table_a, _weights_file, _write

def _calls(freshness, log: Path):
    """The plugin's calls to ``freshness`` as the protocol carries them: call -> reply JSON."""
    (freshness.model_dir / LOG_POINTER).write_bytes(orjson.dumps({"log": str(log)}))
    return lambda **call: orjson.loads(reply_bytes(orjson.dumps({"protocol": PROTOCOL, **call}), freshness.answer))


def test_while_a_rollback_is_under_way_a_second_one_and_publishes_are_refused(tmp_path):
    """A rollback is asked for durably and carried out later by the writer: meanwhile the log
    must not move, so another rollback and any publish get a 409 naming it."""
    log = tmp_path / "log"
    log.mkdir()
    _write(log / "00000001.delta")
    freshness = WorkerFreshness(tmp_path, SharedTables(tmp_path, tmp_path / "weights.pt", hold=-1), LAYOUT, Pace())
    call = _calls(freshness, log)
    asked = call(op="rollback", to=0)
    assert asked == {"protocol": PROTOCOL, "status": 200, "reply": {"rolling_back_to": 0, "from": 1}}
    assert orjson.loads((log / ROLLBACK_MARK).read_bytes()) == {"to": 0, "from": 1}
    again = call(op="rollback", to=0)
    assert again["status"] == 409 and again["error"]["type"] == "Conflict" and "under way" in again["error"]["message"]
    publish = call(op="check", delta=str(_write(tmp_path / "next.delta", sequence=2)))
    assert publish["status"] == 409 and "rollback to 0" in publish["error"]["message"]
    assert call(op="rollback", to=1)["status"] == 409  # to another sequence too


def test_a_rollback_whose_undo_is_missing_undoes_nothing_and_says_which(tmp_path):
    path, _, buffers = _weights_file(tmp_path)
    log = tmp_path / "log"
    log.mkdir()
    _write(log / "00000001.delta")
    _write(log / "00000002.delta", sequence=2, sections=[(TABLES[0], np.array([3, 4]), _rows(TABLES[0], 2, 9))])
    freshness = WorkerFreshness(tmp_path, SharedTables(tmp_path, path, hold=-1), LAYOUT, Pace())
    follower = LogFollower(tmp_path, LAYOUT, TableWriter(path, buffers, LAYOUT), freshness.lock, Pace())
    follower.catch_up(log, Pace())
    assert AppliedState.read(tmp_path).sequence == 2
    applied = _table_a(buffers).clone()
    (log / "00000001.undo").unlink()
    assert _calls(freshness, log)(op="rollback", to=0)["status"] == 200
    with pytest.raises(RuntimeError, match="rollback to 0: 00000001.undo missing .* nothing was undone"):
        follower.catch_up(log, Pace())
    assert torch.equal(_table_a(buffers), applied)  # delta 2's rows too, though its undo is there
    assert AppliedState.read(tmp_path).sequence == 2 and (log / ROLLBACK_MARK).exists()


class _Stop(BaseException):
    """Ends the calls thread's loop in a test (the loop goes on after any ``Exception``)."""


def test_the_calls_thread_logs_a_mailbox_error_and_answers_the_next_calls(monkeypatch, caplog):
    """A mailbox that cannot be read once (a permission, a disk) must not end the thread that
    answers the plugin: every later call would time out."""
    looks = []

    class Mailbox:
        def answer_waiting(self, answer) -> int:
            looks.append(answer)
            if len(looks) == 1:
                raise PermissionError("freshness-calls: permission denied")
            raise _Stop

    freshness = WorkerFreshness.__new__(WorkerFreshness)
    freshness.mailbox = Mailbox()
    monkeypatch.setattr("handlers.runtime.freshness.worker.CALLS_EVERY_S", 0.0)
    with pytest.raises(_Stop):
        freshness._answer_calls()
    assert len(looks) == 2 and "permission denied" in caplog.text


def test_a_worker_loading_past_a_log_entry_it_cannot_apply_serves_what_it_applied_and_says_why(tmp_path):
    """A loading worker replays the log before its first request: an entry it cannot apply (here
    a file that is no delta) must not stop it loading. It serves the entries before it and
    reports the error in its state (``GET /freshness``)."""
    path, _, buffers = _weights_file(tmp_path)
    log = tmp_path / "log"
    log.mkdir()
    _write(log / "00000001.delta")
    (log / "00000002.delta").write_bytes(b"not a delta file")
    freshness = WorkerFreshness(tmp_path, SharedTables(tmp_path, path, hold=-1), LAYOUT, Pace())
    (tmp_path / LOG_POINTER).write_bytes(orjson.dumps({"log": str(log)}))
    freshness.dense = "no dense weights to follow"  # as start() sets it for a runner without any
    freshness._prepare()
    assert _table_a(buffers)[[3, 7, 9]].eq(5).all() and _table_a(buffers)[[2, 8]].eq(0).all()  # delta 1
    state = freshness.state(log)
    assert (state.applied_sequence, state.log_head) == (1, 2)
    assert state.error is not None and "truncated, or not a delta file" in state.error, state.error


def test_a_worker_loading_while_a_rollback_cannot_be_carried_out_serves_what_is_applied_and_says_why(tmp_path):
    """Not only a bad delta file: any error of the log's replay (here a rollback whose undo is
    gone) leaves a loading worker serving the tables as applied and saying why, as the follower
    thread does once it serves; failing the load would have TorchServe restart it into the same."""
    path, _, buffers = _weights_file(tmp_path)
    log = tmp_path / "log"
    log.mkdir()
    _write(log / "00000001.delta")
    _write(log / "00000002.delta", sequence=2, sections=[(TABLES[0], np.array([3, 4]), _rows(TABLES[0], 2, 9))])
    tables = SharedTables(tmp_path, path, hold=-1)
    lock = WorkerFreshness(tmp_path, tables, LAYOUT, Pace()).lock
    LogFollower(tmp_path, LAYOUT, TableWriter(path, buffers, LAYOUT), lock, Pace()).catch_up(log, Pace())
    applied = _table_a(buffers).clone()
    (log / "00000001.undo").unlink()
    loading = WorkerFreshness(tmp_path, tables, LAYOUT, Pace())
    assert _calls(loading, log)(op="rollback", to=0)["status"] == 200
    loading.dense = "no dense weights to follow"  # as start() sets it for a runner without any
    loading._prepare()
    state = loading.state(log)
    assert (state.applied_sequence, state.log_head, state.rolling_back_to) == (2, 2, 0)
    assert state.error is not None and "00000001.undo missing" in state.error, state.error
    assert torch.equal(_table_a(buffers), applied)


def _failing_follower(
    tmp_path, monkeypatch, errors: list[str], clock: list[float], tries: list[float], on_sleep=lambda: None,
    on_try=lambda: None,
) -> WorkerFreshness:
    """A worker whose follower fails with ``errors`` in turn (then ends the loop), on a clock
    that only its sleeps move; ``tries``: the clock at each of the follower's tries."""
    messages = iter(errors)

    class Follower:
        def catch_up(self, log, pace) -> None:
            tries.append(clock[0])
            on_try()
            message = next(messages, None)
            if message is None:
                raise _Stop
            raise RuntimeError(message)

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        on_sleep()

    worker_module = "handlers.runtime.freshness.worker"
    monkeypatch.setattr(f"{worker_module}.lower_this_thread", lambda: None)  # not the test's own thread
    monkeypatch.setattr(f"{worker_module}.log_of", lambda model_dir: tmp_path / "log")
    monkeypatch.setattr(worker, "time", types.SimpleNamespace(sleep=sleep, monotonic=lambda: clock[0]))
    (tmp_path / "log").mkdir()
    freshness = WorkerFreshness.__new__(WorkerFreshness)
    freshness.follower, freshness.error, freshness.pace, freshness.model_dir = Follower(), None, Pace(), tmp_path
    return freshness


def test_a_log_entry_failing_the_same_way_again_is_logged_once_and_retried_less_often(tmp_path, monkeypatch, caplog):
    """The follower thread tries the log every ``FOLLOW_EVERY_S``; an entry that fails the same
    way twice is tried again only after ``RETRY_AFTER_S`` (each try of a raw-id section rebuilds
    a table's slot map) and logged once; another error is logged again."""
    clock, tries = [0.0], []
    freshness = _failing_follower(tmp_path, monkeypatch, ["bad entry 2"] * 3 + ["bad entry 3"], clock, tries)
    with pytest.raises(_Stop):
        freshness._follow()
    follow, retry = worker.FOLLOW_EVERY_S, worker.RETRY_AFTER_S
    gaps = np.diff(tries)
    assert gaps == pytest.approx([follow, retry + follow, retry + follow, follow]), gaps
    assert caplog.text.count("applying the delta log") == 2 and freshness.error == "bad entry 3"


@pytest.mark.parametrize("asked_during", ["the wait", "the failing try"])
def test_a_rollback_asked_while_a_failed_entry_waits_is_tried_at_once(tmp_path, monkeypatch, asked_during):
    """A rollback asked for (through any worker: its mark beside the log) ends the wait before a
    failed entry's next try, also when asked while the try that failed ran: it may undo that entry."""
    clock, tries = [0.0], []

    def ask_a_rollback() -> None:
        if not (tmp_path / "log" / ROLLBACK_MARK).exists():
            mark_rollback(tmp_path / "log", 0, 2)

    if asked_during == "the wait":  # 3 s into it
        hooks = {"on_sleep": lambda: clock[0] >= 3.0 and ask_a_rollback()}
    else:  # during the second try, whose failure (the same again) starts the wait
        hooks = {"on_try": lambda: len(tries) == 2 and ask_a_rollback()}
    freshness = _failing_follower(tmp_path, monkeypatch, ["bad entry 2"] * 3, clock, tries, **hooks)
    with pytest.raises(_Stop):
        freshness._follow()
    asked_at = 3.0 if asked_during == "the wait" else tries[1]
    assert asked_at <= tries[2] <= asked_at + 2 * worker.FOLLOW_EVERY_S, tries  # not RETRY_AFTER_S after tries[1]


def test_a_worker_makes_its_mch_bucket_index_again_once_a_delta_is_applied(tmp_path):
    """A delta shifts a raw-id table's sorted ids in the shared copy: at its first look at the
    applied state once the delta is applied whole, each worker makes its remap's bucket index
    again from them (and only then: it searches every bucket's start in every MCH table)."""
    table = TableSpec(name="t", rows=3000, dim=4, features=["f"], ids="raw", remap={"kind": "mch"})
    remap = served_remap(table)
    remap.load({"t": random_slot_map(table, torch.Generator().manual_seed(0))})
    model = torch.nn.Module()
    model.raw_id_remaps = remap  # as a served model holds it
    freshness = WorkerFreshness(tmp_path, SharedTables(tmp_path, tmp_path / "weights.pt", hold=-1), LAYOUT, Pace())
    freshness.indexed = types.SimpleNamespace(module=model)  # an eager runner

    def fresh() -> bool:
        return torch.equal(remap.bucket_index, index_of(remap.sorted_ids, remap.bucket_tables))

    AppliedState(sequence=1, updated_at=1.0).write(tmp_path)
    freshness._sync_bucket_indexes()
    remap.sorted_ids[:-1] = torch.sort(torch.randint(-(2**62), 2**62, (2999,)))[0]  # a delta's write
    freshness._sync_bucket_indexes()
    assert not fresh()  # the applied state has not changed
    AppliedState(sequence=1, partial=500, updated_at=1.5).write(tmp_path)
    freshness._sync_bucket_indexes()
    assert not fresh()  # the delta is half applied
    AppliedState(sequence=2, updated_at=2.0).write(tmp_path)
    freshness._sync_bucket_indexes()
    assert fresh()
