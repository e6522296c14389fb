"""Stalls of the machine itself, told apart from the server's: a process that does nothing but
sleep 2 ms at a time, and notes each wake-up that came late.

This machine is a shared virtual machine. Now and then every process on it misses its wake-up by
20-250 ms: measured with this probe while a server answered one-item requests with nothing else
going on, the guest's CPUs mostly idle through the stall and the hypervisor's steal counter rising
(and never with the same CPU load and pinned memory made up by plain processes). A request in
flight then shows the stall as latency. The probe lets a benchmark report
which of its slow seconds were the machine's:

    with MachineStalls() as stalls:
        ...                               # serve, publish, measure
    stalls.found                          # [(start, late_s)] on the time.perf_counter clock
    stalls.steal_share                    # the share of the CPUs' time the hypervisor took meanwhile

The probe runs as ``python benchmarks/stalls.py FILE`` (no torch, nothing else imported) and
ends with the block, or by itself once the process that started it is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

SLEEP_S = 0.002
LATE_S = 0.02  # a wake-up this much past its time is a stall: a loaded 2-core machine gives < 15 ms
STEAL = 7  # /proc/stat's eighth CPU time: taken by the hypervisor for other machines


class MachineStalls:
    def __init__(self) -> None:
        self._file: Path | None = None
        self._process: subprocess.Popen | None = None
        self.found: list[tuple[float, float]] = []
        self.steal_share = 0.0
        self._times_at_start: list[int] = []

    def __enter__(self) -> "MachineStalls":
        self._times_at_start = _cpu_times()
        self._file = Path(tempfile.mkstemp(prefix="machine-stalls-", suffix=".txt")[1])
        self._process = subprocess.Popen([sys.executable, __file__, str(self._file)])
        while self._file.stat().st_size == 0:  # the probe's first line: it is running
            if self._process.poll() is not None:
                self._file.unlink()
                raise RuntimeError(f"the stall probe exited with {self._process.returncode}")
            time.sleep(0.01)
        return self

    @property
    def pid(self) -> int:
        assert self._process is not None, "the probe starts on entering the block"
        return self._process.pid

    def __exit__(self, *exc: object) -> None:
        assert self._process is not None and self._file is not None
        self._process.terminate()
        self._process.wait(10)
        lines = self._file.read_text().split("\n")[1:]
        self._file.unlink()
        self.found = [(float(start), float(late)) for start, late in (line.split() for line in lines if line)]
        spent = [now - then for now, then in zip(_cpu_times(), self._times_at_start)]
        self.steal_share = spent[STEAL] / max(1, sum(spent))


def _cpu_times() -> list[int]:
    """The machine's CPU time by kind (/proc/stat's first line: user, nice, system, idle, ..., steal)."""
    with open("/proc/stat") as stat:
        return [int(field) for field in stat.readline().split()[1:]]


def overlaps(stalls: Sequence[tuple[float, float]], start: float, end: float) -> bool:
    """Whether ``[start, end]`` (a request in flight) overlaps one of ``stalls``."""
    return any(at < end and start < at + late for at, late in stalls)


def count_after(stalls: Sequence[tuple[float, float]], times: Sequence[float], after_s: float) -> int:
    """How many of ``times`` fall in one of ``stalls`` or in the ``after_s`` seconds after its end,
    while the requests it held back drain."""
    return sum(1 for t in times if any(at <= t <= at + late + after_s for at, late in stalls))


def main(path: str) -> None:
    parent = os.getppid()
    with open(path, "w", buffering=1) as out:
        out.write("started\n")
        last = time.perf_counter()
        while os.getppid() == parent:
            time.sleep(SLEEP_S)
            now = time.perf_counter()
            if now - last - SLEEP_S > LATE_S:
                out.write(f"{last + SLEEP_S:.6f} {now - last - SLEEP_S:.6f}\n")
            last = now


if __name__ == "__main__":
    main(sys.argv[1])
