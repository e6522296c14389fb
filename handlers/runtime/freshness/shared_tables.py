"""The working copy of a model's tables: the file its workers map and its deltas change, kept in
shared memory and apart from the archive.

Deltas change rows in place in a file that every worker of the model maps. That file must not be
the archive's own: an unzipped archive is served from the model store itself, and writing into it
would change the archive. Nor should it be on disk: every row written dirties a 4 KiB page that
the kernel must write back, and the writeback of the few GiB of random pages that a stretch of
deltas dirties stalled serving for 300 ms every ~20 s when measured. The tables' durability buys
nothing there: the delta log is the durable record, and a fresh copy replays it.

So the first worker of a model copies the archive's tables file into a folder of its own under
``/dev/shm/torchrec-serve`` (tmpfs: memory, no writeback), or, where that lacks the room, under
the system's temporary folder. The folder also holds the copy's freshness state (the applied
sequence, the row lock, the workers' notes), so the copy and what is known about it always go
together. It is named by the archive's folder and fingerprint: every worker of the model finds
the same one. The archive file is read around the page cache (``O_DIRECT``), and whatever of it
was cached already is dropped: nothing reads it again. Left there, 6 GiB of page cache is paged
out by the kernel's cold-page reclaim a minute later, or, dropped at once, given back to the host
by the balloon's free page reporting over the next 20 s; either way the host's work on it
paused the whole virtual machine, serving included, for 20-100 ms at a time.

Each worker maps all of the copy at once and locks its mappings (``pin_in_memory``): the copy is
memory already, but a first touch of each page would cost a page fault on the serving path (the
writer's first write to 100k random rows: 100k faults), and a kernel that reclaims cold pages
(these machines run DAMON's ``pageout`` on pages unused for a minute) would keep unmapping pages
that then fault back in.

Each worker holds a shared lock on the folder's ``hold`` file for as long as it lives, and starts
the folder's keeper (``freshness.keeper``): a process of its own that waits for an exclusive lock
on ``hold`` and removes the folder once it gets it, that is once the last worker of the copy is
gone, however it ended (its model unregistered or scaled to zero, killed, its server stopped).
A folder that nobody holds and no keeper removed (its keeper killed too) goes at the next
``sweep``: at every worker's start, every minute by the follower, and when the launcher stops
TorchServe.

Neither a keeper nor a sweep can remove a copy that a worker is about to serve: a worker serves a
folder only once it holds its ``hold`` shared and finds it still at the folder's path; a remover
renames the folder away while it holds ``hold`` exclusively, so a worker that starts meanwhile
(TorchServe restarting a killed one) waits, finds the folder moved, and makes a new one. The copy itself is made under
the worker's shared hold (``copy.lock`` only orders the workers that find no copy), so no remover
gets between its steps.

    tables = SharedTables.open(model_dir, archive_file, fingerprint)   # copies once, holds it, keeps it
    tables.file      # what the workers map and the writer writes
    tables.folder    # the copy's freshness state
    pin_in_memory(tables.file)    # once mapped: every page mapped now, and kept
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

from handlers.runtime.freshness import keeper
from handlers.runtime.freshness.background import Turns
from handlers.runtime.freshness.keeper import HOLD_FILE, KEEPER_LOCK

logger = logging.getLogger(__name__)

ROOTS = (Path("/dev/shm/torchrec-serve"), Path(tempfile.gettempdir()) / "torchrec-serve-tables")
COPY_LOCK = "copy.lock"
HEADROOM_BYTES = 256 << 20  # left free on the chosen file system beyond the copy
_MLOCK_ONFAULT = 1
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14
PIN_STEP_BYTES = 256 << 20  # pinned per turn
COPY_STEP_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class SharedTables:
    folder: Path
    file: Path
    hold: int  # the open ``hold`` file, locked shared while this process serves the copy
    roots: tuple[Path, ...] = ROOTS  # where copies are made (and swept)

    @classmethod
    def open(
        cls, model_dir: Path, source: Path, fingerprint: str, roots: Sequence[Path] = ROOTS, kept: bool = True
    ) -> "SharedTables":
        """The model's copy of ``source`` (made now if no worker made it yet), held by this
        process until it exits; ``kept``: removed by its keeper once no process holds it (else
        by a sweep)."""
        sweep(roots)
        key = hashlib.sha256(f"{Path(model_dir).resolve()}\n{fingerprint}".encode()).hexdigest()[:16]
        name = f"{Path(model_dir).name}-{key}"
        for _ in range(10):  # a sweep may remove an unheld folder between our steps: start again
            folder = _existing(roots, name, source.name) or _room_for(roots, source) / name
            hold = _hold(folder)
            if hold is None:
                continue
            if kept:
                _start_keeper(folder)
            copy = folder / source.name
            if not copy.exists():
                _copy(source, folder)
            return cls(folder, copy, hold, tuple(roots))
        raise RuntimeError(f"could not hold a copy of {source} under {roots}")


def sweep(roots: Sequence[Path] = ROOTS) -> list[Path]:
    """Removes the copies that no process holds; returns their folders."""
    removed = []
    for root in roots:
        for folder in sorted(root.iterdir()) if root.is_dir() else ():
            try:
                fd = os.open(folder / HOLD_FILE, os.O_RDWR)
            except OSError:
                continue  # being made (its maker holds it as soon as the file exists), or not ours
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # served
            if keeper.remove(folder, fd):  # unless its keeper removed it meanwhile
                removed.append(folder)
                logger.info("removed %s: no worker serves it", folder)
    return removed


def _existing(roots: Sequence[Path], name: str, file_name: str) -> Path | None:
    return next((root / name for root in roots if (root / name / file_name).exists()), None)


def _room_for(roots: Sequence[Path], source: Path) -> Path:
    """The first root with room for a copy of ``source``."""
    needed = source.stat().st_size + HEADROOM_BYTES
    for root in roots:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if shutil.disk_usage(root).free >= needed:
            return root
        logger.warning("%s has %.1f GiB free, a copy of the tables needs %.1f GiB: trying the next place",
                       root, shutil.disk_usage(root).free / 2**30, needed / 2**30)
    raise OSError(f"no room for a {needed / 2**30:.1f} GiB copy of {source.name} in any of {[str(r) for r in roots]}")


def _hold(folder: Path) -> int | None:
    """The folder's ``hold`` file, locked shared; None if a sweep removed the folder meanwhile."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / HOLD_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    if not keeper.is_at(fd, folder / HOLD_FILE):  # removed while we waited for the lock
        os.close(fd)
        return None
    return fd


def _start_keeper(folder: Path) -> None:
    try:
        keeper.spawn(folder)
    except OSError as e:
        logger.warning("no keeper for %s (%s): the next sweep removes it once no worker serves it", folder, e)


def _copy(source: Path, folder: Path) -> None:
    """Copies ``source`` into ``folder`` once, whichever worker gets here first; a folder without
    the copy holds nothing worth keeping (state of an earlier copy that a sweep half removed)."""
    fd = os.open(folder / COPY_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        copy = folder / source.name
        if copy.exists():
            return  # another worker made it while this one waited
        for leftover in folder.iterdir():
            if leftover.name not in (HOLD_FILE, COPY_LOCK, KEEPER_LOCK):
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        started = time.perf_counter()
        staged = copy.with_name(copy.name + ".partial")
        _copy_around_cache(source, staged)
        os.replace(staged, copy)
        _drop_cached_pages(source)  # what was cached before (an archive just built)
        logger.info("copied the tables (%.1f GiB) to %s in %.1fs", copy.stat().st_size / 2**30, copy,
                    time.perf_counter() - started)
    finally:
        os.close(fd)


def _copy_around_cache(source: Path, target: Path) -> None:
    """Copies ``source`` to ``target`` reading it with ``O_DIRECT``: none of it enters the page
    cache. A file system that refuses ``O_DIRECT`` gets a plain copy."""
    try:
        _copy_direct(source, target)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        shutil.copyfile(source, target)


def _copy_direct(source: Path, target: Path) -> None:
    fd = os.open(source, os.O_RDONLY | os.O_DIRECT)
    buffer = mmap.mmap(-1, COPY_STEP_BYTES)  # page-aligned, as O_DIRECT needs
    try:
        with memoryview(buffer) as view, open(target, "wb") as out:
            size, offset = os.fstat(fd).st_size, 0
            while offset < size:  # whole steps until the last (an unaligned offset is refused)
                read = os.preadv(fd, [view], offset)
                if read <= 0:
                    raise OSError(f"{source}: nothing read at byte {offset} of {size}")
                out.write(view[:read])
                offset += read
    finally:
        os.close(fd)
        buffer.close()


def _drop_cached_pages(path: Path) -> None:
    """Lets the kernel drop ``path``'s pages from its page cache now (the workers serve the copy,
    nothing reads the source again), rather than its cold-page reclaim paging gigabytes out
    minutes later, while serving."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages (an archive just built) are not dropped: written first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # pages some process maps stay
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class FileMapping:
    start: int  # address
    end: int
    offset: int  # in the file
    shared: bool  # MAP_SHARED (the writer's) rather than private (a reader's)


def mappings(path: Path) -> list[FileMapping]:
    """This process's mappings of the file ``path``."""
    target = str(Path(path).resolve())
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == target:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append(FileMapping(start, end, int(fields[2], 16), shared=fields[1][3] == "s"))
    return found


def pin_in_memory(path: Path) -> int | str:
    """Maps every page of this process's mappings of ``path`` now and keeps them mapped: a
    reader's mapping read-only (``MADV_POPULATE_READ``: the copy's own pages, no copy-on-write),
    the writer's writable (``MADV_POPULATE_WRITE``), then locked (``mlock2(MLOCK_ONFAULT)``, so
    nothing is read in again). The pages are the copy's, shared by every worker, so this costs
    no memory beyond page tables (2 MiB per GiB mapped), and no forward or row write ever waits
    on a page fault. It goes ``PIN_STEP_BYTES`` at a time, in turns (``background.Turns``): the
    kernel's work, seconds of it for 12 GiB of mappings, would otherwise fill every idle cycle.
    Returns the bytes pinned, or why not (an unprivileged process's ``RLIMIT_MEMLOCK``): serving
    goes on either way."""
    libc = ctypes.CDLL(None, use_errno=True)  # calls release the GIL: the forwards go on
    turns = Turns()
    pinned = 0
    for mapping in mappings(path):
        populate = _MADV_POPULATE_WRITE if mapping.shared else _MADV_POPULATE_READ
        for start in range(mapping.start, mapping.end, PIN_STEP_BYTES):
            address, length = ctypes.c_void_p(start), ctypes.c_size_t(min(PIN_STEP_BYTES, mapping.end - start))
            if libc.madvise(address, length, populate) != 0:
                return f"madvise of {path} failed ({_errno()}): MADV_POPULATE_* needs Linux 5.14"
            if libc.mlock2(address, length, _MLOCK_ONFAULT) != 0:
                return f"mlock2 of {path} failed ({_errno()}): raise the memlock limit (ulimit -l) to keep the tables mapped"
            turns.rest()
        pinned += mapping.end - mapping.start
    return pinned


def _errno() -> str:
    return errno.errorcode.get(ctypes.get_errno(), "?")
