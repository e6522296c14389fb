"""A worker's side of freshness: the row lock its forwards hold, the commands the plugin sends it
(through TorchServe's describe call), and the thread that applies the model's delta log.

The model's delta log is a folder the plugin keeps (``<model store>/deltas/<model>/log``, one
``<sequence>.delta`` per accepted publish, written durably before the publish is answered); the
plugin names it in ``freshness-log.json`` in the model's folder before the first worker loads.
The workers serve, and the writer changes, a working copy of the archive's tables in shared memory
(``freshness.shared_tables``), whose folder also keeps the copy's state. At load, a worker applies
whatever the log holds beyond that state before it serves (a restarted server serves what it
served before), at ``CATCH_UP_ROWS_PER_S``. Afterwards every worker follows the log: the
one that holds the writer lock applies new deltas at the model's pace; if it dies, another takes
the lock and resumes where the state file says.

Dense weights are each worker's own: once the rows of a delta with a dense section are applied,
every worker swaps the section's weights in whole (``freshness.dense``) at its next look at the
log. A worker serves the dense weights of the newest delta applied that has some (the archive's
own when none has: after a rollback past them too). Each worker notes what it serves in
``freshness-workers/<pid>.json``, which the state call reports.

    freshness = WorkerFreshness.open(model_dir, options, config)  # or a str: why no deltas
    runner = load(..., tables=freshness.weights_file)            # the model on the working copy
    runner = LockedRunner(runner, freshness.lock)                # every forward holds it shared
    freshness.start(runner)                                      # replay, then follow the log
    freshness.command({"op": "check", "delta": path})         # the plugin's calls -> JSON answer
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
from handlers.runtime.batching import Batch
from handlers.runtime.errors import ServingError
from handlers.runtime.freshness.applier import AppliedState, Pace, RowLock, TableWriter, apply_delta, write_rows
from handlers.runtime.freshness.background import in_background, lower_this_thread
from handlers.runtime.freshness.config import FreshnessConfig
from handlers.runtime.freshness.delta_file import DeltaError, check_dense, read_delta, read_header
from handlers.runtime.freshness.dense import DenseSlot, dense_slot
from handlers.runtime.freshness.layout import TablesLayout, table_buffers
from handlers.runtime.freshness.shared_tables import SharedTables, pin_in_memory, sweep
from handlers.runtime.options import HandlerOptions

logger = logging.getLogger(__name__)

WORKERS_FOLDER = "freshness-workers"
ROLLBACK_MARK = "rollback.json"  # in the log folder: a rollback asked for and not done yet
FOLLOW_EVERY_S = 0.2
SWEEP_EVERY_S = 60.0  # copies of tables no worker serves any more are removed
# A loading worker's replay of the log: about a quarter of a core here. Faster, it would fill the
# cores that an older version serves on (see ``freshness.background``).
CATCH_UP_ROWS_PER_S = 500_000.0


def log_entries(log: Path) -> dict[int, Path]:
    """The log's deltas by sequence."""
    return {int(p.stem): p for p in Path(log).glob("*.delta") if p.stem.isdigit()}


class WorkerFreshness:
    def __init__(self, model_dir: Path, tables: SharedTables, layout: TablesLayout, pace: Pace) -> None:
        self.model_dir = model_dir
        self.tables = tables  # held while this process lives
        self.folder = tables.folder  # the working copy's state: applied sequence, locks, workers' notes
        self.weights_file = tables.file
        self.layout = layout
        self.pace = pace
        self.dense: DenseSlot | str = "the model is not loaded yet"  # or why it cannot swap dense weights
        self.lock = RowLock(self.folder)
        self._writer_lock = RowLock(self.folder)  # its own open file: excludes this process's readers
        self._writer: TableWriter | None = None  # every worker may become the writer: made at start
        self._thread: threading.Thread | None = None
        self._has_dense: dict[tuple[int, int], bool] = {}  # the log's deltas (by file): which have dense weights
        self.dense_sequence = 0  # the delta whose dense weights this worker serves (0: the archive's)
        self._dense_file: tuple[int, int] | None = None  # that delta's file (a rolled-back one may be replaced)
        self.dense_swap_s: float | None = None
        self.tables_pinned: bool | None = None  # this process's mappings of the copy all mapped, locked
        self.error: str | None = None

    @classmethod
    def open(
        cls, model_dir: Path, options: HandlerOptions, config: FreshnessConfig = FreshnessConfig()
    ) -> "WorkerFreshness | str":
        """Before the model loads: the worker's freshness, holding the working copy of the tables
        (made now by the model's first worker), or why this archive cannot take deltas."""
        archive_file, unsupported = tables_file_name(options)
        if archive_file is None:
            return f"a {options.describe()} archive cannot take deltas: {unsupported}"
        layout = Archive(model_dir).layout
        if layout is None:
            return f"the archive has no {TABLES}: rebuild it with this version to publish deltas"
        if layout.sharded:
            return "sharded tables are copied into each worker at load; deltas need unsharded cpu tables"
        if not (model_dir / LOG_POINTER).exists():
            return "no delta log is named for this model: register it through the plugin to publish deltas"
        try:
            tables = in_background(  # gigabytes copied: at a priority that leaves serving its cores
                lambda: SharedTables.open(model_dir, model_dir / archive_file, layout.fingerprint, config.tables_roots),
                "freshness-copy")
        except OSError as e:  # the model still serves, from the archive's own file
            return f"no working copy of the tables could be made ({e}); free memory or set freshness.tables_dir"
        return cls(model_dir, tables, layout, config.pace)

    # -- serving ---------------------------------------------------------------------------------

    def start(self, runner: object) -> None:
        """``runner``: the model loaded on ``weights_file``. Returns once the log is applied up to
        its head, by this worker (at ``CATCH_UP_ROWS_PER_S``) or by the one applying it already;
        then follows the log."""
        self.dense = dense_slot(runner)
        in_background(self._prepare, "freshness-replay")  # while an older version may serve
        self._note_worker()
        # The follower thread shares this process's GIL with the forwards: let a forward take it
        # back within 1 ms rather than Python's default 5.
        sys.setswitchinterval(0.001)
        self._thread = threading.Thread(target=self._follow, name="freshness", daemon=True)
        self._thread.start()

    def _prepare(self) -> None:
        """The tables mapped, pinned and brought up to the log's head, with the dense weights
        that go with it."""
        # Mapped and pinned before serving: pinning a mapping later (6 GiB: 1.5M pages) would hold
        # up this process's memory calls, the forwards' among them, for a second or more.
        self._writer = _writer(self.weights_file, self.layout)
        self._pin_tables()
        log = self._log()
        while log is not None and self._behind(log):
            self._catch_up(log, Pace(CATCH_UP_ROWS_PER_S, self.pace.chunk_rows))  # or another worker does
            if self._behind(log):
                time.sleep(0.05)
        if log is not None:
            self._sync_dense(log)

    # -- the plugin's calls ----------------------------------------------------------------------

    def command(self, call: dict[str, Any]) -> dict[str, Any]:
        """``check``: is the delta at ``call["delta"]`` the log's next (or a duplicate)?
        ``state``: the applied sequence, rows and this worker's view; ``rollback``: back to
        sequence ``call["to"]``."""
        try:
            if call.get("op") == "check":
                return self._check(Path(call["delta"]), Path(call["log"]))
            if call.get("op") == "state":
                return {"status": 200, **self.state()}
            if call.get("op") == "rollback":
                return self._rollback(int(call["to"]), Path(call["log"]))
            return {"status": 400, "field": "op", "message": f"op: unknown {call.get('op')!r}"}
        except ServingError as error:
            return {"status": error.status, **error.to_body()}

    def state(self) -> dict[str, Any]:
        state = AppliedState.read(self.folder)
        log = self._log()
        head = max(log_entries(log), default=0) if log else 0
        return {
            "base": self.layout.fingerprint,
            "tables_file": str(self.weights_file),  # the working copy the deltas change
            "applied_sequence": state.sequence,
            "log_head": head,
            "rolling_back_to": (_pending_rollback(log) or {}).get("to") if log else None,
            "rows_applied": state.rows_applied,
            "updated_at": state.updated_at,
            "error": self.error,
            "workers": _live_workers(self.folder / WORKERS_FOLDER),
        }

    def _check(self, path: Path, log: Path) -> dict[str, Any]:
        rollback = _pending_rollback(log)
        if rollback is not None:
            return {"status": 409, "type": "Conflict", "message": f"delta: a rollback to {rollback['to']} is under "
                    "way; publish again once GET /freshness no longer shows rolling_back_to"}
        header = read_header(path)
        entries = log_entries(log)
        head = max(entries, default=0)
        if header.base != self.layout.fingerprint:
            raise DeltaError("delta.base", f"is {header.base[:16]}..., the served archive's is {self.layout.fingerprint[:16]}...")
        if header.sequence in entries:
            if filecmp.cmp(entries[header.sequence], path, shallow=False):
                return {"status": 200, "duplicate": True, "sequence": header.sequence, "rows": header.rows}
            raise DeltaError("delta.sequence", f"{header.sequence} was published already, with other contents")
        if header.sequence != head + 1:
            raise DeltaError("delta.sequence", f"must be {head + 1} (the log's next), got {header.sequence}")
        read_delta(path, self.layout)  # every section: table, dtype, dim, checksum, ids
        if header.dense is not None:
            if isinstance(self.dense, str):
                raise DeltaError("dense", f"this archive cannot swap dense weights: {self.dense}")
            check_dense(header.dense, self.dense.dense_shapes())  # type: ignore[arg-type]  # a slot's are shapes
        return {"status": 200, "duplicate": False, "sequence": header.sequence, "rows": header.rows,
                "model": header.model}

    # -- applying --------------------------------------------------------------------------------

    def _log(self) -> Path | None:
        try:
            return Path(orjson.loads((self.model_dir / LOG_POINTER).read_bytes())["log"])
        except FileNotFoundError:
            return None

    def _table_writer(self) -> TableWriter:
        assert self._writer is not None, "start() makes the writer"
        return self._writer

    def _pin_tables(self) -> None:
        started = time.perf_counter()
        pinned = pin_in_memory(self.weights_file)
        if isinstance(pinned, str):
            if self.tables_pinned is not False:
                logger.warning("%s; table pages will be faulted in as rows are read and written", pinned)
        else:
            logger.info("pinned %.1f GiB of table mappings in %.2fs", pinned / 2**30, time.perf_counter() - started)
        self.tables_pinned = self._table_writer().pinned = not isinstance(pinned, str)

    def _rollback(self, to: int, log: Path) -> dict[str, Any]:
        """Asks for the tables as they were after delta ``to`` (0: the archive's own rows): the
        request is written durably beside the log, answered at once, and carried out by the
        model's writer (``_roll_back``) at the model's pace, so that serving goes on meanwhile.
        Publishing waits (409) until it is done."""
        head = max(log_entries(log), default=0)
        if not 0 <= to <= head:
            raise DeltaError("rollback_to", f"must be between 0 and the log's head {head}, got {to}")
        pending = _pending_rollback(log)
        if pending is not None:
            return {"status": 409, "type": "Conflict", "message": f"rollback_to: a rollback to {pending['to']} is under way"}
        mark = Path(log) / ROLLBACK_MARK
        staged = mark.with_name(mark.name + ".tmp")
        with open(staged, "wb") as file:
            file.write(orjson.dumps({"to": to, "from": head}))
            file.flush()
            os.fsync(file.fileno())
        os.replace(staged, mark)
        return {"status": 200, "rolling_back_to": to, "from": head}

    def _roll_back(self, log: Path, to: int) -> None:
        """The writer's part of a rollback, at the model's pace: a delta half applied is finished
        first (its undo is whole once it is), then the undo files, newest first; then the later deltas
        leave the log (moved aside, kept). Done again from the start if the writer dies halfway
        (undoing is idempotent: each undo file holds the bytes from before)."""
        entries = log_entries(log)
        head = max(entries, default=0)
        if AppliedState.read(self.folder).partial:
            self._apply_next(log, entries, self.pace)
        state = AppliedState.read(self.folder)
        missing = [undo_file(log, s).name for s in range(state.sequence, to, -1) if not undo_file(log, s).exists()]
        if missing:  # checked first: undoing some deltas and not others would leave rows the state does not name
            raise RuntimeError(f"rollback to {to}: {', '.join(missing)} missing from {log}, so the rows those deltas "
                               "overwrote cannot be restored; nothing was undone")
        writer = self._table_writer()
        for sequence in range(state.sequence, to, -1):
            write_rows(read_delta(undo_file(log, sequence), self.layout), writer, self._writer_lock, self.pace)
        aside = log.parent / f"rolled-back-{time.strftime('%Y%m%dT%H%M%S')}-from-{head}-to-{to}"
        for sequence in range(to + 1, head + 1):
            aside.mkdir(parents=True, exist_ok=True)
            for path in (entries.get(sequence), undo_file(log, sequence)):
                if path is not None and path.exists():
                    os.replace(path, aside / path.name)
        # a writer behind the log applies the deltas up to ``to`` afterwards, from the log as it is now
        AppliedState(sequence=min(to, state.sequence), partial=0, rows_applied=state.rows_applied,
                     updated_at=time.time()).write(self.folder)
        (Path(log) / ROLLBACK_MARK).unlink()
        logger.info("rolled back from delta %d to %d (later deltas moved to %s)", state.sequence, to, aside)

    def _behind(self, log: Path) -> bool:
        head = max(log_entries(log), default=0)
        return _pending_rollback(log) is not None or AppliedState.read(self.folder).sequence < head

    def _follow(self) -> None:
        lower_this_thread()  # serving first: the writer gets the cores' idle time
        swept = time.monotonic()
        while True:
            time.sleep(FOLLOW_EVERY_S)
            if time.monotonic() - swept > SWEEP_EVERY_S:
                sweep(self.tables.roots)
                swept = time.monotonic()
            log = self._log()
            if log is None:
                continue
            try:
                self._catch_up(log, self.pace)
                self._sync_dense(log)
                self.error = None
            except Exception as e:  # a bad log entry must not stop the worker serving
                if self.error != str(e):
                    logger.exception("applying the delta log %s failed", log)
                self.error = str(e)

    def _catch_up(self, log: Path, pace: Pace) -> None:
        if not self._behind(log):
            return
        with self.lock.sole_writer(self.folder) as writer:
            if not writer:
                return  # another worker applies them
            entries = log_entries(log)
            rollback = _pending_rollback(log)
            if rollback is not None:
                self._roll_back(log, rollback["to"])
                entries = log_entries(log)
            while self._apply_next(log, entries, pace):
                pass

    def _apply_next(self, log: Path, entries: dict[int, Path], pace: Pace) -> bool:
        """Applies (or finishes) the delta after the applied sequence; False when there is none."""
        state = AppliedState.read(self.folder)
        path = entries.get(state.sequence + 1)
        if path is None:
            return False
        started = time.perf_counter()
        delta = read_delta(path, self.layout)
        apply_delta(delta, self._table_writer(), self._writer_lock, self.folder, pace, start_row=state.partial,
                    undo=undo_file(log, delta.header.sequence))
        logger.info("applied delta %d (%d rows) in %.2fs", delta.header.sequence, delta.header.rows,
                    time.perf_counter() - started)
        return True

    def _sync_dense(self, log: Path) -> None:
        """Swaps in the dense weights this worker should serve: those of the newest applied delta
        that has a dense section, or the archive's own."""
        if isinstance(self.dense, str):
            return
        applied = AppliedState.read(self.folder).sequence
        entries = log_entries(log)
        wanted = max((s for s, path in entries.items() if s <= applied and self._dense_in(path)), default=0)
        source = _identity(entries[wanted]) if wanted else None
        if source == self._dense_file:
            return
        started = time.perf_counter()
        self.dense.swap_dense(read_delta(entries[wanted], self.layout).dense() if wanted else None)
        self.dense_swap_s = time.perf_counter() - started
        self.dense_sequence, self._dense_file = wanted, source
        self._note_worker()
        logger.info("serving the dense weights of delta %d (swapped in %.3fs)", wanted, self.dense_swap_s)

    def _dense_in(self, path: Path) -> bool:
        key = _identity(path)
        if key not in self._has_dense:
            self._has_dense[key] = read_header(path).dense is not None
        return self._has_dense[key]

    def _note_worker(self) -> None:
        """What this worker serves, for the state call (answered by any of the model's workers)."""
        folder = self.folder / WORKERS_FOLDER
        folder.mkdir(exist_ok=True)
        note = folder / f"{os.getpid()}.json"
        staged = note.with_name(note.name + ".tmp")
        staged.write_bytes(orjson.dumps({"pid": os.getpid(), "dense_sequence": self.dense_sequence,
                                         "dense_swap_s": self.dense_swap_s, "tables_pinned": self.tables_pinned,
                                         "since": time.time()}))
        os.replace(staged, note)


def _writer(weights_file: Path, layout: TablesLayout) -> TableWriter:
    """A writer of the tables in ``weights_file`` (its buffers found through a mapping of the file
    that goes once this returns)."""
    return TableWriter(weights_file, table_buffers(torch.load(weights_file, mmap=True, weights_only=True)), layout)


def _identity(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_ino, status.st_mtime_ns


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


def _pending_rollback(log: Path) -> dict[str, int] | None:
    """The rollback asked for and not done yet: ``{"to": ..., "from": ...}``."""
    try:
        return orjson.loads((Path(log) / ROLLBACK_MARK).read_bytes())
    except FileNotFoundError:
        return None


def undo_file(log: Path, sequence: int) -> Path:
    """The rows delta ``sequence`` overwrote, kept beside it in the log for a rollback."""
    return Path(log) / f"{sequence:08d}.undo"


class LockedRunner:
    """A runner whose every forward holds the model's row lock shared."""

    def __init__(self, runner: Callable[[Batch], torch.Tensor], lock: RowLock) -> None:
        self.runner = runner
        self.lock = lock

    def __call__(self, batch: Batch) -> torch.Tensor:
        with self.lock.reading():
            return self.runner(batch)
