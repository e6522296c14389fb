"""Memory of TorchServe's model workers (RSS and PSS), of any server process (PSS), and of the
served tables."""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from pathlib import Path
from typing import Sequence

import psutil

from handlers.modeling.factory import DLRMFactory
from handlers.modeling.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class WorkerMemory:
    workers: int
    rss_mib: float  # summed over workers
    pss_mib: float  # summed over workers: shared pages counted once in total


def model_workers(server_pid: int) -> list[psutil.Process]:
    """TorchServe's Python model workers under the frontend process."""
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    workers = []
    for child in children:
        try:
            if any("model_service_worker" in part for part in child.cmdline()):
                workers.append(child)
        except psutil.Error:
            continue
    return workers


def worker_memory(server_pid: int) -> WorkerMemory:
    rss = pss = 0
    workers = model_workers(server_pid)
    for worker in workers:
        try:
            info = worker.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += info.pss
    return WorkerMemory(workers=len(workers), rss_mib=rss / 2**20, pss_mib=pss / 2**20)


def pss_mib(pid: int) -> float:
    """The process's proportional set size (``/proc/PID/smaps_rollup``): each page it maps
    counted divided by the number of processes that map it, so summed over processes a shared
    page counts once."""
    for line in (Path("/proc") / str(pid) / "smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/{pid}/smaps_rollup: no Pss line")


_MAPPING = re.compile(rb"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")


def mapped_mib(pid: int, folders: Sequence[Path]) -> dict[str, float]:
    """The process's mappings of files under ``folders``, summed from ``/proc/PID/smaps``:
    resident (``rss``), proportional (``pss``) and private MiB. A file every process maps
    shared is all ``rss`` and no ``private``."""
    prefixes = tuple(str(folder).encode() + b"/" for folder in folders)
    sums = {"rss": 0, "pss": 0, "private": 0}
    counted = False
    for line in (Path("/proc") / str(pid) / "smaps").read_bytes().splitlines():
        header = _MAPPING.match(line)
        if header is not None:
            counted = header.group(1).startswith(prefixes)
        elif counted:
            key, _, value = line.partition(b":")
            field = {b"Rss": "rss", b"Pss": "pss", b"Private_Clean": "private", b"Private_Dirty": "private"}.get(key)
            if field is not None:
                sums[field] += int(value.split()[0])  # kB
    return {field: kb / 1024 for field, kb in sums.items()}


class PeakSampler:
    """Samples the workers' summed RSS in the background (e.g. while a model loads)."""

    def __init__(self, server_pid: int, interval_s: float = 0.05) -> None:
        self.server_pid = server_pid
        self.interval_s = interval_s
        self.peak_rss_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = 0
            for worker in model_workers(self.server_pid):
                try:
                    rss += worker.memory_info().rss
                except psutil.Error:
                    continue
            self.peak_rss_mib = max(self.peak_rss_mib, rss / 2**20)
            time.sleep(self.interval_s)


def table_memory_mib(spec: ModelSpec) -> dict[str, float]:
    """MiB of each served table (rows of packed values plus per-row scale/bias)."""
    return {name: size / 2**20 for name, size in DLRMFactory(spec).table_bytes().items()}
