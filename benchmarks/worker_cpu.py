"""The CPU time of TorchServe's Python workers, or of every process of a server, from the
kernel's accounting (``/proc``).

A worker's CPU per item is what the handler costs, protocol included, whatever the client:
``worker_cpu_s(group)`` before and after a load level, over the items it answered.
``group_cpu_s(group)``: the whole server's (TorchServe's frontend and workers, or the asgi
engine's processes), to compare engines.

    before = worker_cpu_s(server.process.pid)     # the server's process group
    ...                                           # a load level
    us_per_item = (worker_cpu_s(server.process.pid) - before) / result.items * 1e6
"""

from __future__ import annotations

import os
from pathlib import Path

WORKER_SCRIPT = b"model_service_worker.py"
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def worker_cpu_s(group: int) -> float:
    """User + system CPU seconds of the live worker processes of process group ``group``."""
    return sum(int(fields[11]) + int(fields[12]) for fields in _workers(group).values()) / _TICKS_PER_S


def group_cpu_s(group: int) -> float:
    """User + system CPU seconds of every live process of process group ``group``."""
    return sum(int(fields[11]) + int(fields[12]) for fields in _group(group).values()) / _TICKS_PER_S


def worker_pids(group: int) -> list[int]:
    """The live TorchServe worker processes of process group ``group``."""
    return sorted(_workers(group))


def _workers(group: int) -> dict[int, list[bytes]]:
    """``_group(group)``, its TorchServe worker processes only."""
    return _group(group, WORKER_SCRIPT)


def _group(group: int, command: bytes = b"") -> dict[int, list[bytes]]:
    """pid -> the fields of /proc/PID/stat after "pid (comm) " (state, ppid, pgrp, ...; utime is
    the 12th, stime the 13th), for each process of the group whose command line holds ``command``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            if command and command not in (entry / "cmdline").read_bytes():
                continue
        except OSError:  # gone since the listing
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[2]) == group:
            found[int(entry.name)] = fields
    return found
