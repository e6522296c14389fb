"""The writer's part of freshness: bringing the model's working copy of the tables up to its
delta log, one delta at a time at the model's pace, and carrying out a rollback asked for.

Every worker runs a ``LogFollower``; the one that holds the model's writer lock applies, the
others find nothing to do. The applied sequence lives in the working copy's folder
(``applier.AppliedState``), so a writer that dies midway is resumed by the next one.

    follower = LogFollower(copy_folder, layout, writer, lock, pace)
    follower.catch_up(log, pace)     # returns at once unless this worker is the writer and behind
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from handlers.runtime.freshness.applier import AppliedState, Pace, RowLock, TableWriter, apply_delta, write_rows
from handlers.runtime.freshness.delta_file import read_delta
from handlers.runtime.freshness.layout import TablesLayout
from handlers.runtime.freshness.log import clear_rollback, log_entries, log_head, pending_rollback, undo_file

logger = logging.getLogger(__name__)


class LogFollower:
    """``folder``: the working copy's state folder; ``readers``: the row lock the forwards hold
    shared (its sole-writer lock picks the model's writer)."""

    def __init__(self, folder: Path, layout: TablesLayout, writer: TableWriter, readers: RowLock, pace: Pace) -> None:
        self.folder = folder
        self.layout = layout
        self.writer = writer
        self.readers = readers
        self.pace = pace
        self._writer_lock = RowLock(folder)  # its own open file: excludes this process's readers

    def behind(self, log: Path) -> bool:
        return pending_rollback(log) is not None or AppliedState.read(self.folder).sequence < log_head(log)

    def catch_up(self, log: Path, pace: Pace) -> None:
        """Applies what the log holds beyond the applied sequence (a rollback asked for first),
        if this worker is the model's writer."""
        if not self.behind(log):
            return
        with self.readers.sole_writer(self.folder) as writer:
            if not writer:
                return  # another worker applies them
            entries = log_entries(log)
            rollback = pending_rollback(log)
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
        apply_delta(delta, self.writer, self._writer_lock, self.folder, pace, start_row=state.partial,
                    undo=undo_file(log, delta.header.sequence))
        logger.info("applied delta %d (%d rows) in %.2fs", delta.header.sequence, delta.header.rows,
                    time.perf_counter() - started)
        return True

    def _roll_back(self, log: Path, to: int) -> None:
        """A rollback, at the model's pace: a delta half applied is finished first (its undo is
        whole once it is), then the undo files, newest first; then the later deltas leave the log
        (moved aside, kept). The applied sequence steps down as each delta is undone, so a writer
        that dies halfway is followed by one that goes on from there."""
        entries = log_entries(log)
        head = max(entries, default=0)
        if AppliedState.read(self.folder).partial:
            self._apply_next(log, entries, self.pace)
        state = AppliedState.read(self.folder)
        missing = [undo_file(log, s).name for s in range(state.sequence, to, -1) if not undo_file(log, s).exists()]
        if missing:  # checked first: undoing some deltas and not others would leave rows the state does not name
            raise RuntimeError(f"rollback to {to}: {', '.join(missing)} missing from {log}, so the rows those deltas "
                               "overwrote cannot be restored; nothing was undone")
        for sequence in range(state.sequence, to, -1):
            write_rows(read_delta(undo_file(log, sequence), self.layout), self.writer, self._writer_lock, self.pace,
                       staging=self.folder)
            # undone: a writer that dies later goes on from the next (a raw-id table's owners, unlike
            # rows, cannot take an older delta's undo twice)
            AppliedState(sequence=sequence - 1, partial=0, rows_applied=state.rows_applied,
                         updated_at=time.time()).write(self.folder)
        aside = log.parent / f"rolled-back-{time.strftime('%Y%m%dT%H%M%S')}-from-{head}-to-{to}"
        for sequence in range(to + 1, head + 1):
            aside.mkdir(parents=True, exist_ok=True)
            for path in (entries.get(sequence), undo_file(log, sequence)):
                if path is not None and path.exists():
                    os.replace(path, aside / path.name)
        # a writer behind the log applies the deltas up to ``to`` afterwards, from the log as it is now
        AppliedState(sequence=min(to, state.sequence), partial=0, rows_applied=state.rows_applied,
                     updated_at=time.time()).write(self.folder)
        clear_rollback(log)
        logger.info("rolled back from delta %d to %d (later deltas moved to %s)", state.sequence, to, aside)
