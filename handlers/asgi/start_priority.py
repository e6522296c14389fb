"""A process of the ASGI engine starts below serving's CPU priority: until its models are loaded
(torch's import, the archives' load: seconds of CPU) every thread of it runs at nice
``START_NICE``, then each gets its first nice back. A process that uvicorn's supervisor starts in
place of one that died then takes the CPU its serving siblings leave, not theirs (a sibling
starved by a loading process queues its requests past the admission target, and sheds them). The
TorchServe plugin does the same for TorchServe's workers (``StartPriority.java``).

Raising a thread back needs CAP_SYS_NICE or an RLIMIT_NICE that reaches its first nice: without
either the process starts at its normal priority (never stuck low) and the log says why.

    restore = start_low()     # in the process, before it loads anything
    ...                       # load the models
    restore()                 # every thread back to the nice it had
"""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

START_NICE = 10
CAP_SYS_NICE = 23
TASKS = Path("/proc/self/task")


def start_low() -> Callable[[], None]:
    """Lowers every thread of this process to ``START_NICE`` (new threads inherit it); returns what
    raises them back."""
    first = os.getpriority(os.PRIO_PROCESS, 0)
    refused = _refusal(first)
    if refused is not None or first >= START_NICE:
        if refused is not None:
            logger.warning("this process starts at serving's CPU priority: %s", refused)
        return lambda: None
    for thread in _threads():
        _set_nice(thread, START_NICE)

    def restore() -> None:
        for thread in _threads():
            if _nice(thread) == START_NICE:  # not a thread that set its own (freshness work runs idle)
                _set_nice(thread, first)
        logger.info("loaded: back from nice %d to %d", START_NICE, first)

    return restore


def _refusal(first: int) -> str | None:
    """Why this process could not raise itself back to nice ``first``, or None if it can."""
    if not TASKS.is_dir():
        return "no /proc here (Linux only)"
    status = Path("/proc/self/status").read_text()
    capabilities = next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), "0")
    if int(capabilities, 16) >> CAP_SYS_NICE & 1:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - soft <= first:
        return None
    return (f"raising it back from nice {START_NICE} to {first} needs CAP_SYS_NICE or an RLIMIT_NICE of "
            f"{20 - first} or more (ulimit -e), and it has neither")


def _threads() -> list[int]:
    return [int(task.name) for task in TASKS.iterdir()]


def _nice(thread: int) -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, thread)  # a thread id: that thread alone on Linux
    except OSError:  # ended meanwhile
        return None


def _set_nice(thread: int, nice: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, thread, nice)
    except ProcessLookupError:  # ended meanwhile
        pass
