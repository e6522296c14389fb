"""Publishing deltas to a model of the ASGI engine, as the TorchServe plugin does
(``FreshnessEndpoint.java``), with the runtime's freshness code unchanged: the process answering
the call asks its own ``WorkerFreshness`` (check, rollback, state; the calls the plugin sends
through the mailbox), and copies an accepted delta into the model's log, on disk before it answers.
Every process of the server follows that log: the one holding the writer lock applies the rows in
place in the tables' one shared working copy, under the row lock; each swaps dense weights itself.

Publishes and rollbacks of a model are one at a time across the server's processes (a lock file
beside the log), as the plugin's are within its one JVM.

    answer = publish(model, store, "tiny-00000001.delta")   # {"model", "version", "sequence", ...}
    rollback(model, 0)                                      # {"rolling_back_to": 0, "from": 1}
    state(model)                                            # {"applied_sequence", "log_head", ...}
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from handlers.asgi.placing import store_file
from handlers.asgi.registry import ServedModel
from handlers.runtime.errors import Conflict
from handlers.runtime.freshness.log import log_of
from handlers.runtime.freshness.protocol import Check, Checked, Rollback, State
from handlers.runtime.freshness.worker import WorkerFreshness

PUBLISH_LOCK = "publish.lock"


def publish(model: ServedModel, store: Path, name: str) -> dict[str, Any]:
    """The delta file ``name`` of ``<store>/deltas/`` checked whole and appended to the model's log."""
    freshness, log = _freshness(model)
    delta = store_file(Path(store) / "deltas", name, "delta")
    with _one_at_a_time(log):
        checked = freshness.answer(Check(delta))
        assert isinstance(checked, Checked)
        if not checked.duplicate:
            append(delta, log, checked.sequence)
    return {"model": model.name, "version": model.version, "sequence": checked.sequence, "rows": checked.rows,
            "duplicate": checked.duplicate, "log": str(log)}


def rollback(model: ServedModel, to: int) -> dict[str, Any]:
    freshness, log = _freshness(model)
    with _one_at_a_time(log):
        return freshness.answer(Rollback(to)).to_reply()


def state(model: ServedModel) -> dict[str, Any]:
    """The plugin's state answer: each live process of the server is one of its workers, with the
    fields the plugin gives each TorchServe worker (its rows are the working copy's: the applied
    sequence is every process's)."""
    freshness, log = _freshness(model)
    reply = freshness.answer(State()).to_reply()
    reply["workers"] = [{"pid": note["pid"], "status": "WORKER_MODEL_LOADED", "applied_sequence": reply["applied_sequence"],
                         "dense_sequence": note["dense_sequence"], "dense_swap_s": note["dense_swap_s"]}
                        for note in reply["workers"]]
    return {"model": model.name, "version": model.version, "log": str(log), **reply}


def append(delta: Path, log: Path, sequence: int) -> Path:
    """``delta`` copied into ``log`` as ``sequence``, flushed to disk (the file and the rename)."""
    log.mkdir(parents=True, exist_ok=True)
    target = log / f"{sequence:08d}.delta"
    staged = log / f".{sequence:08d}.delta.partial"
    shutil.copyfile(delta, staged)
    with open(staged, "rb+") as file:
        os.fsync(file.fileno())
    os.replace(staged, target)
    folder = os.open(log, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return target


def _freshness(model: ServedModel) -> tuple[WorkerFreshness, Path]:
    label = f"model {model.name} version {model.version}"
    if isinstance(model.freshness, str):
        raise Conflict(f"{label} takes no deltas: {model.freshness}")
    log = log_of(model.freshness.model_dir)
    if log is None:  # placed by the engine, it always has one; a table-less archive is refused above
        raise Conflict(f"{label} has no delta log named")
    return model.freshness, log


@contextlib.contextmanager
def _one_at_a_time(log: Path) -> Iterator[None]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log.parent / PUBLISH_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
