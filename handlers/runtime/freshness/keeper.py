"""The keeper of a working copy of tables: a small process that waits until no worker holds the
copy's folder (``shared_tables``), removes the folder, and exits.

Workers rarely end by their own code: TorchServe's frontend kills a worker (``SIGKILL``) when its
model is unregistered or scaled down, a crashed or killed worker runs nothing, and a stopped
server's workers die with it. So each worker that holds a copy starts a keeper for it, in a session
of its own (a signal to the server's process group does not reach it), that outlives them:

    spawn(folder)    # returns at once; the keeper runs ``python -I -S keeper.py FOLDER``

The keeper takes the folder's ``keeper.lock`` (a second keeper of a folder exits at once: one per
folder, and one that was killed is replaced by the next worker that starts), then waits for an
exclusive lock on ``hold``, which every worker of the copy holds shared while it lives. Once it
has it, no worker is left: it removes the folder (``remove``) and exits; it exits as well where a
sweep removed the folder first. It imports the standard library alone (the worker's copy of this
package need not be on its path), sleeps in the kernel meanwhile, and runs at a low priority of
the normal policy (nice 10), not the ``SCHED_IDLE`` of the worker's background thread that may
start it: an idle-policy keeper got no core at all while serving kept both busy, and the copy's
gigabytes stayed in memory for as long.

A folder is removed by renaming it out of the way first, then deleting it: a worker that starts
meanwhile never finds half a folder at the model's path, only the whole old folder (whose
``hold`` it then waits for and finds moved: ``is_at``) or none (it makes a new one).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HOLD_FILE = "hold"
KEEPER_LOCK = "keeper.lock"
REMOVED_MARK = ".removed-"  # in the name a folder is given while it is deleted


def spawn(folder: Path) -> None:
    """Starts ``folder``'s keeper (it exits at once where one keeps the folder already)."""
    keeper = subprocess.Popen(
        [sys.executable, "-I", "-S", str(Path(__file__).resolve()), str(folder)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # not TorchServe's pipes
        close_fds=True, start_new_session=True, cwd="/",
    )
    threading.Thread(target=keeper.wait, name="tables-keeper", daemon=True).start()  # no zombie left


def keep(folder: Path) -> bool:
    """Waits until no process holds ``folder`` and removes it; False where another keeper keeps
    it or it was removed meanwhile."""
    try:
        keeper = os.open(folder / KEEPER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        hold = os.open(folder / HOLD_FILE, os.O_RDWR)
    except FileNotFoundError:
        return False  # removed already
    try:
        fcntl.flock(keeper, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    if not is_at(keeper, folder / KEEPER_LOCK):  # the folder was replaced while this keeper opened it
        return False
    fcntl.flock(hold, fcntl.LOCK_EX)  # until the last worker of the copy is gone
    return remove(folder, hold)


def is_at(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the one at ``path`` now (not removed, nor replaced)."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (found.st_dev, found.st_ino)


def remove(folder: Path, hold: int) -> bool:
    """Removes ``folder`` where ``hold``, the caller's open ``hold`` file, locked exclusively, is
    still the folder's (False where it was removed meanwhile); closes ``hold``. The folder is
    renamed away, its lock released (a worker waiting for it finds it moved and makes a new
    copy at once), then deleted."""
    try:
        if not is_at(hold, folder / HOLD_FILE):
            return False
        doomed = folder.with_name(f"{folder.name}{REMOVED_MARK}{os.getpid()}-{time.monotonic_ns()}")
        os.rename(folder, doomed)
    finally:
        os.close(hold)
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def _low_priority() -> None:
    """The normal scheduling policy at nice 10 (where the system lets this process leave an
    inherited ``SCHED_IDLE``; else it stays idle)."""
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, 10)
    except OSError:
        pass


if __name__ == "__main__":
    _low_priority()
    keep(Path(sys.argv[1]))
