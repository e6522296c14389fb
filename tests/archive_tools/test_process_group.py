"""``stop_group`` on a tree shaped like a local server's (a launcher waiting on a frontend waiting
on a worker): each process is killed before its parent, so its own parent reaps it (the
machine's init is never left to); a parent that starts a new child for each one killed is stopped
all the same."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from archive_tools.process_group import stop_group

# Each level starts the next (argv: log, its depth, the deepest, whether to respawn), then waits on
# it and logs how its child ended: a line a parent writes once it has reaped its child itself.
_LEVEL = """
import subprocess, sys, time
log, depth, deepest, respawn = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if depth == deepest:
    time.sleep(600)
while True:
    next_level = [log, str(depth + 1), str(deepest), sys.argv[4], sys.argv[5]]
    child = subprocess.Popen([sys.executable, "-c", sys.argv[5], *next_level])
    code = child.wait()
    with open(log, "a") as out:
        out.write(f"{depth + 1} {code}\\n")
    if not respawn:
        time.sleep(600)
"""


def _tree(tmp_path, deepest: int, respawn: bool) -> tuple[subprocess.Popen, str]:
    log = str(tmp_path / "reaped.log")
    arguments = [log, "0", str(deepest), "1" if respawn else "0", _LEVEL]
    launcher = subprocess.Popen([sys.executable, "-c", _LEVEL, *arguments], start_new_session=True)
    deadline = time.monotonic() + 30
    while len(_group(launcher.pid)) < deepest + 1:  # every level started
        assert time.monotonic() < deadline, "the tree did not start"
        time.sleep(0.05)
    return launcher, log


def _group(pgid: int) -> list[int]:
    found = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_each_process_is_killed_before_its_parent_and_reaped_by_it(tmp_path):
    launcher, log = _tree(tmp_path, deepest=2, respawn=False)
    stop_group(launcher)
    assert launcher.returncode == -9 and _gone(launcher.pid)
    with open(log) as reaped:  # the frontend reaped its worker, the launcher its frontend
        assert sorted(reaped.read().split("\n")[:-1]) == ["1 -9", "2 -9"]


@pytest.mark.parametrize("deepest", [1, 2])
def test_a_parent_that_replaces_each_child_killed_is_stopped_too(tmp_path, deepest):
    launcher, _ = _tree(tmp_path, deepest=deepest, respawn=True)
    stop_group(launcher)
    assert launcher.returncode == -9 and _gone(launcher.pid)
