"""Freshness work that yields the machine's cores to serving.

Besides its forwards, a worker copies and replays tables when a model (or a new version of it)
loads, and follows the delta log afterwards. Loading a version while the old one serves kept a
core busy for tens of seconds (the 6 GiB copy, pinning it, the replay of every delta in the log),
and on a two-core machine the old version's forwards queued behind it until requests were
refused. So that work runs on threads scheduled ``SCHED_IDLE``: Linux gives such a thread a core
only when no other thread of the machine wants it, and takes the core back as soon as one does.
Linux schedules threads, not processes: the policy is the thread's alone; the worker's main
thread, which runs the forwards, keeps its own.

Idle CPU is not free on a virtual machine, though: when both vCPUs are busy and the host has work
of its own for the machine (disk reads, memory given back and taken again), the whole machine
pauses for tens of ms at a time, serving included. So work that would fill every idle cycle for
seconds (pinning the tables, replaying the log) also keeps to a share of the time (``Turns``).

    tables = in_background(lambda: SharedTables.open(...), "tables copy")  # waits; returns its value
    lower_this_thread()    # at the start of a long-lived background thread
    turns = Turns(0.5)     # then, after each step of a loop: turns.rest()
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def lower_this_thread() -> None:
    """Schedules the calling thread ``SCHED_IDLE``, or at nice 19 where that is refused (a
    warning where both are)."""
    thread = threading.get_native_id()
    try:
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as idle_refused:  # not Linux, or a sandbox that refuses it
        try:
            os.setpriority(os.PRIO_PROCESS, thread, 19)  # a thread id: that thread alone on Linux
        except (AttributeError, OSError) as nice_refused:
            logger.warning("freshness work runs at serving's priority (SCHED_IDLE: %s; nice 19: %s)",
                           idle_refused, nice_refused)


class Turns:
    """Keeps a loop of background work to ``share`` of the wall time: ``rest()`` after each step
    sleeps in proportion to how long the step ran (``share`` 0.5: a step of 40 ms, then 40 ms
    of sleep)."""

    def __init__(self, share: float = 0.5) -> None:
        self.share = share
        self._began = time.perf_counter()

    def rest(self) -> None:
        ran = time.perf_counter() - self._began
        time.sleep(ran * (1 - self.share) / self.share)
        self._began = time.perf_counter()


def in_background(work: Callable[[], T], name: str) -> T:
    """Runs ``work`` on a lowered thread of its own and returns its result (or raises its error)
    once it ends; the calling thread waits meanwhile."""
    outcome: dict[str, object] = {}

    def run() -> None:
        lower_this_thread()
        try:
            outcome["value"] = work()
        except BaseException as error:  # handed to the caller, raised there
            outcome["error"] = error

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
