"""The working copy of a model's tables: made once for all its workers, apart from the archive,
kept while a worker holds it and removed once none does."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from handlers.runtime.archive_files import INPUTS, LOG_POINTER, MAILBOX, REFUSED
from handlers.runtime.freshness import keeper, shared_tables
from handlers.runtime.freshness.applier import STATE_FILE
from handlers.runtime.freshness.shared_tables import (
    SharedTables,
    _copy_around_cache,
    _drop_cached_pages,
    pin_in_memory,
    sweep,
)


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    folder = tmp_path / "archive"
    folder.mkdir()
    (folder / "weights.pt").write_bytes(os.urandom(8 << 20))  # 2,048 pages
    return folder


def _release(tables: SharedTables) -> None:
    os.close(tables.hold)  # as a worker's exit does


def test_the_workers_of_a_model_share_one_copy_and_the_archive_stays_as_it_was(archive, tmp_path):
    roots = (tmp_path / "shm",)
    source = archive / "weights.pt"
    original = source.read_bytes()
    first = SharedTables.open(archive, source, "f" * 64, roots)
    second = SharedTables.open(archive, source, "f" * 64, roots)
    assert first.file == second.file and first.file.parent.parent == roots[0]
    assert first.file.read_bytes() == original
    with open(first.file, "r+b") as copy:  # a delta's row
        copy.write(b"\xff" * 16)
    assert source.read_bytes() == original and second.file.read_bytes()[:16] == b"\xff" * 16
    other_weights = SharedTables.open(archive, source, "e" * 64, roots)  # the archive rebuilt
    assert other_weights.folder != first.folder
    for tables in (first, second, other_weights):
        _release(tables)


def _cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (``mincore`` on a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), size) as mapped:
        resident = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), resident) == 0, ctypes.get_errno()
        return sum(page & 1 for page in resident)


def test_the_archives_pages_leave_the_page_cache_once_copied(archive, tmp_path):
    """Nothing reads them again; left there, the kernel's cold-page reclaim pages them out later
    (GiBs of them, minutes after the copy), while the model serves."""
    source = archive / "weights.pt"
    source.read_bytes()
    assert _cached_pages(source) > 1000  # of 2,048
    tables = SharedTables.open(archive, source, "f" * 64, (tmp_path / "shm",))
    assert _cached_pages(source) == 0
    _release(tables)


def test_the_copy_reads_the_archive_around_the_page_cache(tmp_path):
    """Dropped later, GiBs of cached archive are given back to the host while the model serves."""
    source = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, (16 << 20) + 12345, dtype=np.uint8).tobytes()  # a short last step
    source.write_bytes(data)
    _drop_cached_pages(source)
    assert _cached_pages(source) == 0
    _copy_around_cache(source, tmp_path / "copy.bin")
    assert _cached_pages(source) == 0
    assert (tmp_path / "copy.bin").read_bytes() == data


def test_a_file_system_that_refuses_o_direct_gets_a_plain_copy(tmp_path, monkeypatch):
    def refused(*args):
        raise OSError(errno.EINVAL, "O_DIRECT: invalid argument")

    monkeypatch.setattr(shared_tables, "_copy_direct", refused)
    (tmp_path / "weights.bin").write_bytes(b"rows" * 1000)
    _copy_around_cache(tmp_path / "weights.bin", tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == b"rows" * 1000


def test_a_copy_is_kept_while_any_worker_holds_it_and_swept_after(archive, tmp_path):
    roots = (tmp_path / "shm",)
    first = SharedTables.open(archive, archive / "weights.pt", "f" * 64, roots, kept=False)
    second = SharedTables.open(archive, archive / "weights.pt", "f" * 64, roots, kept=False)
    _release(first)
    assert sweep(roots) == [] and first.file.exists()
    _release(second)
    assert sweep(roots) == [first.folder] and not first.folder.exists()


def _serve(archive: Path, roots: tuple[Path, ...], ready, kept: bool) -> None:
    SharedTables.open(archive, archive / "weights.pt", "f" * 64, roots, kept=kept)
    ready.set()
    signal.pause()  # until killed


def _serving(archive: Path, roots: tuple[Path, ...], kept: bool = True):
    """A process that holds the copy (as a worker does) until it is killed."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    worker = context.Process(target=_serve, args=(archive, roots, ready, kept))
    worker.start()
    assert ready.wait(60)
    return worker


def test_a_killed_worker_lets_go_of_its_copy(archive, tmp_path):
    roots = (tmp_path / "shm",)
    worker = _serving(archive, roots, kept=False)
    try:
        assert sweep(roots) == []
    finally:
        worker.kill()
        worker.join()
    (folder,) = sweep(roots)
    assert not folder.exists()


def _gone_within(folder: Path, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not folder.exists()


def test_the_keeper_removes_a_copy_once_its_last_worker_is_killed_and_not_before(archive, tmp_path):
    """Killed (as TorchServe ends a worker it scales down), a worker runs none of its own code:
    the copy goes all the same, with nothing left of it in its root."""
    roots = (tmp_path / "shm",)
    workers = [_serving(archive, roots), _serving(archive, roots)]
    (folder,) = roots[0].iterdir()
    workers[0].kill()
    workers[0].join()
    assert not _gone_within(folder, timeout_s=1.0)  # the other worker serves it
    assert (folder / "weights.pt").read_bytes() == (archive / "weights.pt").read_bytes()
    workers[1].kill()
    workers[1].join()
    assert _gone_within(folder)
    # renamed out of the way first (keeper.REMOVED_MARK), then deleted: nothing left once deleted
    deadline = time.monotonic() + 10.0
    while any(roots[0].iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(roots[0].iterdir()) == []


def _run_keeper(folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-I", "-S", keeper.__file__, str(folder)])


def test_a_folder_has_one_keeper(archive, tmp_path):
    tables = SharedTables.open(archive, archive / "weights.pt", "f" * 64, (tmp_path / "shm",))  # its keeper waits
    _wait_for_keeper(tables.folder)
    assert _run_keeper(tables.folder).wait(timeout=10) == 0  # a second one exits at once
    assert tables.file.exists()
    _release(tables)
    assert _gone_within(tables.folder)


def _wait_for_keeper(folder: Path) -> None:
    """Until a keeper holds the folder's keeper lock."""
    fd = os.open(folder / keeper.KEEPER_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        for _ in range(200):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(fd, fcntl.LOCK_UN)
            time.sleep(0.05)
        raise AssertionError(f"no keeper holds {folder}")
    finally:
        os.close(fd)


def test_a_keeper_whose_copy_a_sweep_removed_exits_and_leaves_the_new_copy_alone(archive, tmp_path):
    roots = (tmp_path / "shm",)
    old = SharedTables.open(archive, archive / "weights.pt", "f" * 64, roots, kept=False)
    sweeping = os.open(old.folder / keeper.HOLD_FILE, os.O_RDWR)
    _release(old)
    fcntl.flock(sweeping, fcntl.LOCK_EX)  # as a sweep does, before the keeper gets it
    waiting = _run_keeper(old.folder)
    _wait_for_keeper(old.folder)
    assert keeper.remove(old.folder, sweeping)  # and releases it
    new = SharedTables.open(archive, archive / "weights.pt", "f" * 64, roots, kept=False)  # a worker starts
    assert new.folder == old.folder
    assert waiting.wait(timeout=10) == 0
    assert new.file.read_bytes() == (archive / "weights.pt").read_bytes()
    assert [p.name for p in roots[0].iterdir()] == [new.folder.name]
    _release(new)


def test_a_half_swept_copy_is_made_again_without_its_old_state(archive, tmp_path):
    """State without the tables it describes must not be trusted: a fresh copy starts from the
    archive's rows, so its state starts from nothing."""
    roots = (tmp_path / "shm",)
    tables = SharedTables.open(archive, archive / "weights.pt", "f" * 64, roots)
    (tables.folder / STATE_FILE).write_text('{"sequence": 7}')
    tables.file.unlink()  # held meanwhile, so no sweep removes the folder
    again = SharedTables.open(archive, archive / "weights.pt", "f" * 64, roots)
    assert again.folder == tables.folder
    assert again.file.read_bytes() == (archive / "weights.pt").read_bytes()
    assert not (again.folder / STATE_FILE).exists()
    _release(tables)
    _release(again)


def test_a_place_that_cannot_hold_the_copy_is_passed_over(archive, tmp_path):
    (tmp_path / "a-file").write_text("")
    unusable = tmp_path / "a-file" / "shm"
    tables = SharedTables.open(archive, archive / "weights.pt", "f" * 64, (unusable, tmp_path / "tmp"))
    assert tables.folder.parent == tmp_path / "tmp"
    _release(tables)
    with pytest.raises(OSError, match="no room for a"):
        SharedTables.open(archive, archive / "weights.pt", "e" * 64, (unusable,))


def test_a_mapped_copy_is_pinned_whole_without_a_copy_of_its_pages(archive, tmp_path):
    """Every page of a reader's (private) and the writer's (shared) mapping is mapped at once and
    locked; the reader's pages stay the copy's own (no copy-on-write: anonymous memory does not
    grow), and a row written through the shared mapping is seen through the private one."""
    tables = SharedTables.open(archive, archive / "weights.pt", "f" * 64, (tmp_path / "shm",))
    with open(tables.file, "r+b") as file:
        reader = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        writer = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED)
    anonymous = _status_kib("RssAnon")
    pinned = pin_in_memory(tables.file)
    if isinstance(pinned, str):  # an unprivileged process past its memlock limit: says why
        assert "ulimit -l" in pinned
    else:
        assert pinned == 2 * len(reader)
        assert _status_kib("VmLck") >= 2 * len(reader) // 1024
        assert _status_kib("RssAnon") - anonymous < len(reader) // 1024 // 2
    writer[:4] = b"\x01\x02\x03\x04"
    assert reader[:4] == b"\x01\x02\x03\x04"
    reader.close()
    writer.close()
    _release(tables)


def _status_kib(field: str) -> int:
    """A figure of this process's ``/proc/self/status``, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def test_a_worker_with_no_room_for_a_copy_serves_without_deltas_and_says_why(tiny_spec, tiny_weights, tmp_path, monkeypatch):
    from handlers.modeling.factory import DLRMFactory
    from handlers.modeling.registry import input_schema
    from handlers.runtime.freshness import worker
    from handlers.runtime.options import HandlerOptions

    factory = DLRMFactory(tiny_spec)
    factory.save_weights(tiny_weights, tmp_path / "weights.pt")
    factory.tables_layout(tmp_path / "weights.pt").save(tmp_path)
    input_schema(tiny_spec).save(tmp_path / INPUTS)
    (tmp_path / LOG_POINTER).write_text("{}")  # registered through the plugin

    def no_room(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(worker.SharedTables, "open", no_room)
    reason = worker.WorkerFreshness.open(tmp_path, HandlerOptions())
    assert reason == (
        "no working copy of the tables could be made ([Errno 28] No space left on device); "
        "free memory or set freshness.tables_dir"
    )
    # the plugin's calls are answered with it (409), by the mailbox's refusal
    assert orjson.loads((tmp_path / MAILBOX / REFUSED).read_bytes()) == {"message": reason}
