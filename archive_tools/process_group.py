"""Stopping a local server's process group with every process reaped at once.

A killed process stays (a zombie, still a member of its group) until its parent reaps it. A
server's launcher waits on its frontend and the frontend on its workers, so, killed from the leaves
up, each goes as soon as it dies. Killed all together, the launcher dies first: the others are
handed to the machine's init, which reaps them when it gets round to it (1.9 s a stop here, where
PID 1 is a VM's agent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

ROUNDS = 6  # a launcher, a frontend, its workers and their children are four levels


def stop_group(launcher: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Kills every process of ``launcher``'s group (started with ``start_new_session``: the group's
    id is its pid), those with no child in the group first, and reaps ``launcher``; whatever is
    left of the group after ``ROUNDS`` (a parent that starts a new child for each one killed) or
    ``timeout_s`` gets ``SIGKILL`` at once."""
    deadline = time.monotonic() + timeout_s
    for _ in range(ROUNDS):
        group = _members(launcher.pid)
        if not group:
            break
        leaves = [pid for pid in group if pid not in group.values()]
        for pid in leaves:
            _kill(pid)
        while any(_exists(pid) for pid in leaves) and time.monotonic() < deadline:
            launcher.poll()  # the launcher is ours to reap
            time.sleep(0.005)
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launcher.wait(timeout=10)
    _wait_for_group_exit(launcher.pid, timeout_s=10)


def _members(pgid: int) -> dict[int, int]:
    """The group's living processes (zombies left out): {pid: its parent's pid}."""
    members = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                state, parent, group = stat.read().rsplit(")", 1)[1].split()[:3]  # after the command's name
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(group) == pgid and state != "Z":
            members[int(entry.name)] = int(parent)
    return members


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _exists(pid: int) -> bool:
    """Whether ``pid`` is running or a zombie not reaped yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for_group_exit(pgid: int, timeout_s: float) -> None:
    """Until no process of the group is left (killed workers release their locks as they go)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
