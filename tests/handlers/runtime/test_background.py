"""Freshness work on lowered threads: the work runs ``SCHED_IDLE``, the caller keeps its policy,
and the work's value or error comes back to the caller; a loop of it keeps to its share of the
time."""

from __future__ import annotations

import os
import threading

import pytest

from handlers.runtime.freshness import background
from handlers.runtime.freshness.background import Turns, in_background


def _policy() -> int:
    return os.sched_getscheduler(threading.get_native_id())


def test_work_runs_on_an_idle_priority_thread_and_the_caller_keeps_its_own():
    before = _policy()
    seen = in_background(lambda: (threading.get_native_id(), _policy()), "test")
    assert seen[0] != threading.get_native_id()
    assert seen[1] == os.SCHED_IDLE
    assert _policy() == before == os.SCHED_OTHER


def test_where_sched_idle_is_refused_the_work_runs_at_nice_19(monkeypatch):
    def refused(*args):
        raise PermissionError("sched_setscheduler: not permitted")

    monkeypatch.setattr(background.os, "sched_setscheduler", refused)
    nice = in_background(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), "test")
    assert nice == 19 and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 19


def test_the_works_error_is_raised_in_the_caller():
    def fail() -> None:
        raise ValueError("tables: no room")

    with pytest.raises(ValueError, match="tables: no room"):
        in_background(fail, "test")


def test_turns_rest_in_proportion_to_the_step_so_the_work_keeps_its_share(monkeypatch):
    clock = iter([0.0, 0.040, 0.160, 0.220, 0.400])  # steps of 40 ms and of 60 ms, each slept after
    slept = []
    monkeypatch.setattr(background.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(background.time, "sleep", slept.append)
    turns = Turns(0.25)
    turns.rest()
    turns.rest()
    assert slept == pytest.approx([0.120, 0.180])  # a quarter of the time working
