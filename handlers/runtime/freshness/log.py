"""A model's delta log, as files: ``<sequence>.delta`` per accepted publish (the plugin appends
them), ``<sequence>.undo`` beside each (the rows it overwrote, kept by the writer for a rollback),
and ``rollback.json`` while a rollback asked for is not done yet. The model's folder names the
log in ``freshness-log.json`` (written by the plugin when it registers the model).
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson

from handlers.runtime.archive_files import LOG_POINTER

ROLLBACK_MARK = "rollback.json"


def log_of(model_dir: Path) -> Path | None:
    """The log the plugin named for the model in ``model_dir``, or None."""
    try:
        return Path(orjson.loads((Path(model_dir) / LOG_POINTER).read_bytes())["log"])
    except FileNotFoundError:
        return None


def log_entries(log: Path) -> dict[int, Path]:
    """The log's deltas by sequence."""
    return {int(p.stem): p for p in Path(log).glob("*.delta") if p.stem.isdigit()}


def log_head(log: Path) -> int:
    """The sequence of the log's newest delta (0: none)."""
    return max(log_entries(log), default=0)


def undo_file(log: Path, sequence: int) -> Path:
    """The rows delta ``sequence`` overwrote, kept beside it in the log for a rollback."""
    return Path(log) / f"{sequence:08d}.undo"


def pending_rollback(log: Path) -> dict[str, int] | None:
    """The rollback asked for and not done yet: ``{"to": ..., "from": ...}``."""
    try:
        return orjson.loads((Path(log) / ROLLBACK_MARK).read_bytes())
    except FileNotFoundError:
        return None


def mark_rollback(log: Path, to: int, head: int) -> None:
    """Records, durably, that the tables are to be as they were after delta ``to``."""
    mark = Path(log) / ROLLBACK_MARK
    staged = mark.with_name(mark.name + ".tmp")
    with open(staged, "wb") as file:
        file.write(orjson.dumps({"to": to, "from": head}))
        file.flush()
        os.fsync(file.fileno())
    os.replace(staged, mark)


def clear_rollback(log: Path) -> None:
    (Path(log) / ROLLBACK_MARK).unlink()
