"""A worker's side of freshness: the row lock its forwards hold, the plugin's calls
(``freshness.protocol``), and the thread that follows the model's delta log.

The model's delta log is a folder the plugin keeps (``freshness.log``), named in the model's
folder before the first worker loads. The workers serve, and the writer changes, a working copy
of the archive's tables in shared memory (``freshness.shared_tables``), whose folder also keeps
the copy's state. At load, a worker applies whatever the log holds beyond that state before it
serves (a restarted server serves what it served before), at ``CATCH_UP_ROWS_PER_S``. Afterwards
every worker follows the log (``freshness.follower``, on a thread at the lowest priority): the one
that holds the writer lock applies new deltas at the model's pace; if it dies, another takes the
lock and resumes where the state file says. Another thread, at serving's priority, answers the
plugin's calls, so that a long apply or a busy machine does not hold them up.

Dense weights are each worker's own: once the rows of a delta with a dense section are applied,
every worker swaps the section's weights in whole (``freshness.dense``) at its next look at the
log. Each worker notes what it serves in ``freshness-workers/<pid>.json``, which the state call
reports.

    freshness = WorkerFreshness.open(model_dir, options, config)  # or a str: why no deltas
    runner = load(..., tables=freshness.weights_file)            # the model on the working copy
    runner = LockedRunner(runner, freshness.lock)                # every forward holds it shared
    freshness.start(runner)                                      # replay, then follow the log
"""

from __future__ import annotations

import filecmp
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import orjson
import torch

from handlers.runtime.archive import Archive, tables_file_name
from handlers.runtime.archive_files import LOG_POINTER, TABLES
from handlers.runtime.artifacts import served_tensors
from handlers.runtime.batching import Batch
from handlers.runtime.errors import Conflict
from handlers.runtime.freshness.applier import AppliedState, Pace, RowLock, TableWriter
from handlers.runtime.freshness.background import in_background, lower_this_thread
from handlers.runtime.freshness.config import FreshnessConfig
from handlers.runtime.freshness.delta_file import DeltaError, check_dense, read_delta, read_header
from handlers.runtime.freshness.dense import DenseFollower, dense_slot
from handlers.runtime.freshness.follower import LogFollower
from handlers.runtime.freshness.layout import TablesLayout, table_buffers
from handlers.runtime.freshness.log import log_entries, log_head, log_of, mark_rollback, pending_rollback
from handlers.runtime.freshness.protocol import (
    Call,
    Check,
    Checked,
    FreshnessState,
    Mailbox,
    Reply,
    Rollback,
    RollbackAsked,
    write_whole,
)
from handlers.runtime.freshness.shared_tables import SharedTables, pin_in_memory, sweep
from handlers.runtime.freshness.slot_writes import check_owners
from handlers.runtime.id_buckets import is_index, refresh
from handlers.runtime.options import HandlerOptions
from handlers.runtime.slot_maps import slot_maps_in

logger = logging.getLogger(__name__)

WORKERS_FOLDER = "freshness-workers"
CALLS_EVERY_S = 0.05  # how often the plugin's calls are looked for
FOLLOW_EVERY_S = 0.2  # how often the log is
SWEEP_EVERY_S = 60.0  # copies of tables no worker serves any more are removed
RETRY_AFTER_S = 10.0  # a log entry that failed the same way twice is tried again this much later,
# or as soon as a rollback is asked for
# A loading worker's replay of the log: about a quarter of a core here. Faster, it would fill the
# cores that an older version serves on (see ``freshness.background``).
CATCH_UP_ROWS_PER_S = 500_000.0


def _until_rollback_asked(log: Path, asked: dict[str, int] | None, seconds: float) -> None:
    """Waits ``seconds``, or less: until the log's rollback mark is other than ``asked`` (a
    rollback asked through any of the model's workers; it may undo the entry that failed)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and _rollback_mark(log) == asked:
        time.sleep(min(FOLLOW_EVERY_S, left))


def _rollback_mark(log: Path) -> dict[str, int] | None:
    """``pending_rollback``, or None where the mark cannot be read now (the follower goes on)."""
    try:
        return pending_rollback(log)
    except (OSError, ValueError):
        return None


class WorkerFreshness:
    def __init__(self, model_dir: Path, tables: SharedTables, layout: TablesLayout, pace: Pace) -> None:
        self.model_dir = model_dir
        self.tables = tables  # held while this process lives
        self.folder = tables.folder  # the working copy's state: applied sequence, locks, workers' notes
        self.weights_file = tables.file
        self.layout = layout
        self.pace = pace
        self.mailbox = Mailbox(model_dir)
        self.lock = RowLock(self.folder)
        # the calls thread's own open file: its unlock must not release the forwards' shared lock
        self._checks_lock = RowLock(self.folder)
        self.follower: LogFollower | None = None  # every worker may become the writer: made at start
        self.dense: DenseFollower | str = "the model is not loaded yet"  # or why it cannot swap dense weights
        self.tables_pinned: bool | None = None  # this process's mappings of the copy all mapped, locked
        self.error: str | None = None
        self.indexed: object = None  # the model served, where it has MCH bucket indexes to make again
        self._indexed_at: float | None = None  # the time of the applied state they were last made for

    @classmethod
    def open(
        cls, model_dir: Path, options: HandlerOptions, config: FreshnessConfig = FreshnessConfig()
    ) -> "WorkerFreshness | str":
        """Before the model loads: the worker's freshness, holding the working copy of the tables
        (made now by the model's first worker), or why this archive cannot take deltas (the
        plugin's calls are then answered 409 with it)."""
        archive = Archive(model_dir)
        layout = archive.layout
        why = cls._why_not(model_dir, options, layout)
        if why is None and layout is not None:
            schema = archive.inputs
            raw = {f.raw_id_table for f in schema.features + schema.context_sparse} - {None}
            unmarked = sorted(raw - {t.name for t in layout.tables if t.raw_ids})  # type: ignore[arg-type]
            if unmarked:
                why = f"its {TABLES} predates raw-id deltas (tables {unmarked}): rebuild it with this version"
        if why is not None:
            if (model_dir / LOG_POINTER).exists():  # the plugin would call: it is told why
                Mailbox(model_dir).refuse(why)
            return why
        assert layout is not None  # _why_not checked
        archive_file = model_dir / tables_file_name(options)[0]  # type: ignore[operator]
        try:
            tables = in_background(  # gigabytes copied: at a priority that leaves serving its cores
                lambda: SharedTables.open(model_dir, archive_file, layout.fingerprint, config.tables_roots),
                "freshness-copy")
        except OSError as e:  # the model still serves, from the archive's own file
            why = f"no working copy of the tables could be made ({e}); free memory or set freshness.tables_dir"
            Mailbox(model_dir).refuse(why)
            return why
        Mailbox(model_dir).accept()
        return cls(model_dir, tables, layout, config.pace)

    @staticmethod
    def _why_not(model_dir: Path, options: HandlerOptions, layout: TablesLayout | None) -> str | None:
        unsupported = tables_file_name(options)[1]
        if unsupported is not None:
            return f"a {options.describe()} archive cannot take deltas: {unsupported}"
        if layout is None:
            return f"the archive has no {TABLES}: rebuild it with this version to publish deltas"
        if layout.sharded:
            return "sharded tables are copied into each worker at load; deltas need unsharded cpu tables"
        if not (model_dir / LOG_POINTER).exists():
            return "no delta log is named for this model: register it through the plugin to publish deltas"
        return None

    # -- serving ---------------------------------------------------------------------------------

    def start(self, runner: object) -> None:
        """``runner``: the model loaded on ``weights_file``. Returns once the log is applied up to
        its head, by this worker (at ``CATCH_UP_ROWS_PER_S``) or by the one applying it already;
        then follows the log."""
        slot = dense_slot(runner)
        self.dense = slot if isinstance(slot, str) else DenseFollower(slot, self.layout, self.folder)
        if any(is_index(name) for name, _ in served_tensors(runner)):  # type: ignore[arg-type]
            self.indexed = runner
        self._start(self._answer_calls, "freshness-calls")  # the plugin's calls, answered from now on
        in_background(self._prepare, "freshness-replay")  # while an older version may serve
        self._note_worker()
        # The follower thread shares this process's GIL with the forwards: let a forward take it
        # back within 1 ms rather than Python's default 5.
        sys.setswitchinterval(0.001)
        self._start(self._follow, "freshness")

    @staticmethod
    def _start(target: Callable[[], None], name: str) -> None:
        threading.Thread(target=target, name=name, daemon=True).start()

    def _prepare(self) -> None:
        """The tables mapped, pinned and brought up to the log's head, with the dense weights
        that go with it."""
        # Mapped and pinned before serving: pinning a mapping later (6 GiB: 1.5M pages) would hold
        # up this process's memory calls, the forwards' among them, for a second or more.
        weights = torch.load(self.weights_file, mmap=True, weights_only=True)
        writer = TableWriter(
            self.weights_file, table_buffers(weights, self.layout.buffer_constants), self.layout, slot_maps_in(weights)
        )
        self.follower = LogFollower(self.folder, self.layout, writer, self.lock, self.pace)
        self._pin_tables(writer)
        log = log_of(self.model_dir)
        try:
            while log is not None and self.follower.behind(log):
                self.follower.catch_up(log, Pace(CATCH_UP_ROWS_PER_S, self.pace.chunk_rows))  # or another worker does
                if self.follower.behind(log):
                    time.sleep(0.05)
        except Exception as e:  # an entry or a rollback that fails: serve what is applied, say why
            logger.exception("the delta log %s cannot be applied past sequence %d", log, AppliedState.read(self.folder).sequence)
            self.error = str(e)
        if log is not None:
            self._sync_dense(log)
        self._sync_bucket_indexes()

    def _pin_tables(self, writer: TableWriter) -> None:
        started = time.perf_counter()
        pinned = pin_in_memory(self.weights_file)
        if isinstance(pinned, str):
            if self.tables_pinned is not False:
                logger.warning("%s; table pages will be faulted in as rows are read and written", pinned)
        else:
            logger.info("pinned %.1f GiB of table mappings in %.2fs", pinned / 2**30, time.perf_counter() - started)
        self.tables_pinned = writer.pinned = not isinstance(pinned, str)

    def _answer_calls(self) -> None:
        while True:
            time.sleep(CALLS_EVERY_S)
            try:
                self.mailbox.answer_waiting(self.answer)
            except Exception:  # an unreadable mailbox must not stop this worker answering the next call
                logger.exception("answering the plugin's freshness calls failed")

    def _follow(self) -> None:
        lower_this_thread()  # serving first: the writer gets the cores' idle time
        swept = time.monotonic()
        while True:
            time.sleep(FOLLOW_EVERY_S)
            if time.monotonic() - swept > SWEEP_EVERY_S:
                sweep(self.tables.roots)
                swept = time.monotonic()
            log = log_of(self.model_dir)
            if log is None:
                continue
            asked = _rollback_mark(log)  # before the try: a rollback asked during it ends the wait below
            try:
                self.follower.catch_up(log, self.pace)  # type: ignore[union-attr]  # made before this thread
                self._sync_dense(log)
                self._sync_bucket_indexes()
                self.error = None
            except Exception as e:  # a bad log entry must not stop the worker serving
                if self.error != str(e):
                    logger.exception("applying the delta log %s failed", log)
                else:  # the same again: try less often (a raw-id table's map is rebuilt each try)
                    _until_rollback_asked(log, asked, RETRY_AFTER_S)
                self.error = str(e)

    def _sync_dense(self, log: Path) -> None:
        if isinstance(self.dense, DenseFollower) and self.dense.sync(log):
            self._note_worker()

    def _sync_bucket_indexes(self) -> None:
        """The MCH remaps' bucket indexes made again from the sorted ids once a delta has been
        applied or undone since they were made (not while one is half applied: 0.4-0.8 s of
        work at the Criteo 1TB size). Until then an id whose owners moved is searched over its
        whole table (``handlers.runtime.id_buckets``)."""
        if self.indexed is None:
            return
        state = AppliedState.read(self.folder)
        if state.partial == 0 and state.updated_at != self._indexed_at:
            refresh(served_tensors(self.indexed))  # type: ignore[arg-type]
            self._indexed_at = state.updated_at

    # -- the plugin's calls ----------------------------------------------------------------------

    def answer(self, call: Call) -> Reply:
        log = log_of(self.model_dir)
        if log is None:
            raise Conflict("no delta log is named for this model: register it through the plugin")
        if isinstance(call, Check):
            return self._check(call.delta, log)
        if isinstance(call, Rollback):
            return self._rollback(call.to, log)
        return self.state(log)

    def state(self, log: Path) -> FreshnessState:
        state = AppliedState.read(self.folder)
        return FreshnessState(
            base=self.layout.fingerprint,
            tables_file=str(self.weights_file),
            applied_sequence=state.sequence,
            log_head=log_head(log),
            rolling_back_to=(pending_rollback(log) or {}).get("to"),
            rows_applied=state.rows_applied,
            updated_at=state.updated_at,
            error=self.error,
            workers=_live_workers(self.folder / WORKERS_FOLDER),
        )

    def _check(self, path: Path, log: Path) -> Checked:
        rollback = pending_rollback(log)
        if rollback is not None:
            raise Conflict(f"delta: a rollback to {rollback['to']} is under way; publish again once "
                           "GET /freshness no longer shows rolling_back_to", "delta")
        header = read_header(path)
        entries = log_entries(log)
        head = max(entries, default=0)
        if header.base != self.layout.fingerprint:
            raise DeltaError("delta.base", f"is {header.base[:16]}..., the served archive's is {self.layout.fingerprint[:16]}...")
        if header.sequence in entries:
            if filecmp.cmp(entries[header.sequence], path, shallow=False):
                return Checked(header.sequence, header.rows, duplicate=True, model=header.model)
            raise DeltaError("delta.sequence", f"{header.sequence} was published already, with other contents")
        if header.sequence != head + 1:
            raise DeltaError("delta.sequence", f"must be {head + 1} (the log's next), got {header.sequence}")
        delta = read_delta(path, self.layout)  # every section: table, dtype, dim, checksum, ids
        if any(t.owners for t in delta.header.tables):
            if self.follower is None:  # its tables and slot maps are mapped once it has loaded
                raise Conflict("delta: this worker is still loading the tables; publish again once it is ready", "delta")
            applied = AppliedState.read(self.folder).sequence
            pending = [read_delta(entries[s], self.layout) for s in range(applied + 1, head + 1)]
            with self._checks_lock.reading():  # not while a writer copies a map's span
                check_owners(self.follower.writer, delta, pending)
        if header.dense is not None:
            if isinstance(self.dense, str):
                raise DeltaError("dense", f"this archive cannot swap dense weights: {self.dense}")
            check_dense(header.dense, self.dense.slot.dense_shapes())  # type: ignore[arg-type]  # a slot's are shapes
        return Checked(header.sequence, header.rows, duplicate=False, model=header.model)

    def _rollback(self, to: int, log: Path) -> RollbackAsked:
        """Asks for the tables as they were after delta ``to`` (0: the archive's own rows): the
        request is written durably beside the log, answered at once, and carried out by the
        model's writer at the model's pace, so that serving goes on meanwhile. Publishing waits
        (409) until it is done."""
        head = log_head(log)
        if not 0 <= to <= head:
            raise DeltaError("rollback_to", f"must be between 0 and the log's head {head}, got {to}")
        pending = pending_rollback(log)
        if pending is not None:
            raise Conflict(f"rollback_to: a rollback to {pending['to']} is under way", "rollback_to")
        mark_rollback(log, to, head)
        return RollbackAsked(to, head)

    def _note_worker(self) -> None:
        """What this worker serves, for the state call (answered by any of the model's workers)."""
        folder = self.folder / WORKERS_FOLDER
        folder.mkdir(exist_ok=True)
        dense = self.dense if isinstance(self.dense, DenseFollower) else None
        write_whole(folder / f"{os.getpid()}.json", orjson.dumps({
            "pid": os.getpid(), "dense_sequence": dense.sequence if dense else 0,
            "dense_swap_s": dense.swap_s if dense else None, "tables_pinned": self.tables_pinned, "since": time.time()}))


def _live_workers(folder: Path) -> list[dict[str, Any]]:
    """The notes of the model's workers that are still running."""
    notes = []
    for note in sorted(Path(folder).glob("*.json")):
        try:
            os.kill(int(note.stem), 0)
            notes.append(orjson.loads(note.read_bytes()))
        except (ProcessLookupError, ValueError, FileNotFoundError):
            continue
    return notes


class LockedRunner:
    """A runner whose every forward holds the model's row lock shared."""

    def __init__(self, runner: Callable[[Batch], torch.Tensor], lock: RowLock) -> None:
        self.runner = runner
        self.lock = lock

    def __call__(self, batch: Batch) -> torch.Tensor:
        with self.lock.reading():
            return self.runner(batch)
