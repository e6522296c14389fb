"""The machine-stall probe: a probe held still (as a stalled machine holds every process) reports it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.stalls import MachineStalls, count_after, overlaps
from tests.conftest import REPO


def test_a_probe_held_still_for_150_ms_reports_one_stall_of_that_length():
    """The hold is one stall; the machine may add stalls of its own beside it (one of 30 ms, 80 ms
    before the hold, in a CI run), which are not in the hold's time."""
    with MachineStalls() as stalls:
        time.sleep(0.2)
        os.kill(stalls.pid, signal.SIGSTOP)
        held = time.perf_counter()
        time.sleep(0.15)
        os.kill(stalls.pid, signal.SIGCONT)
        time.sleep(0.2)
    in_hold = [(at, late) for at, late in stalls.found if overlaps([(at, late)], held, held + 0.15)]
    assert len(in_hold) == 1, stalls.found
    start, late = in_hold[0]
    assert held - 0.01 < start < held + 0.01
    assert 0.13 < late < 0.3
    assert 0 <= stalls.steal_share < 1


def test_a_request_overlaps_a_stall_only_if_in_flight_during_it():
    stalls = [(10.0, 0.1)]
    assert overlaps(stalls, 9.9, 10.05) and overlaps(stalls, 10.05, 10.2) and overlaps(stalls, 9.0, 11.0)
    assert not overlaps(stalls, 9.0, 9.99) and not overlaps(stalls, 10.11, 10.3) and not overlaps([], 0.0, 1.0)


def test_times_count_after_a_stall_during_it_and_while_it_drains():
    stalls = [(10.0, 0.1), (20.0, 0.05)]
    assert count_after(stalls, [9.99, 10.0, 10.05, 10.6, 10.61, 20.3, 30.0], after_s=0.5) == 4
    assert count_after([], [1.0], after_s=1.0) == 0


def test_the_probe_ends_by_itself_once_the_process_that_started_it_is_gone(tmp_path):
    code = ("import os; from benchmarks.stalls import MachineStalls; "
            "print(MachineStalls().__enter__().pid, flush=True); os._exit(0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    probe = int(done.stdout)
    deadline = time.monotonic() + 5
    while _running(probe) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _running(probe)
    if left:
        os.kill(probe, signal.SIGKILL)
    assert not left


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # an orphan's zombie, not yet reaped, runs no more


def test_a_probe_that_cannot_start_is_an_error_leaving_no_file(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(RuntimeError, match="the stall probe exited with 1"):
        MachineStalls().__enter__()
    assert not list(tmp_path.iterdir())
