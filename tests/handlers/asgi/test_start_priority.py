"""A starting process runs below serving's priority until loaded: every thread at ``START_NICE``,
threads it starts meanwhile too, then every one back to its first nice (a process of its own: the
test's own threads keep their priority)."""

import os
import subprocess
import sys

import pytest

from handlers.asgi.start_priority import START_NICE, _refusal

PROGRAM = """
import os, threading
from handlers.asgi.start_priority import start_low

def nices():
    return sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})

restore = start_low()
lowered = nices()
started = threading.Event()
stop = threading.Event()
worker = threading.Thread(target=lambda: (started.set(), stop.wait()))
worker.start()
started.wait()
with_new_thread = os.getpriority(os.PRIO_PROCESS, worker.native_id)
restore()
print(lowered, with_new_thread, nices())
stop.set()
"""


@pytest.mark.skipif(_refusal(os.getpriority(os.PRIO_PROCESS, 0)) is not None, reason="this process may not raise a nice back")
def test_every_thread_starts_low_and_gets_its_nice_back():
    first = os.getpriority(os.PRIO_PROCESS, 0)
    assert first < START_NICE
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split("\n")[0] == f"[{START_NICE}] {START_NICE} [{first}]", done.stderr
