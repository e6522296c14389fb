"""The compiled open-loop client: ``wrk`` sending Poisson arrivals at a fixed rate, so that the
load takes little of the machine from the server it measures (the Python open loop took 0.57 of
its two cores at 3,080 requests/s; this one 0.13 at 2,535, paced).

Each wrk thread draws its share of the arrivals in advance; a connection that is free claims the
next one, and ``delay()`` returns the wait for it. A connection waits for its answer before it
sends again (HTTP/1.1, no pipelining), so an arrival that comes while every connection of its
thread waits is sent late, as soon as one is free: while the server is that slow it sees fewer
arrivals than the rate, as a closed loop's server would (coordinated omission), and fewer of them
fail. ``late_sends`` counts the requests sent ``LATE_S`` or more after their arrival and
``achieved_rps`` is the rate kept, so that a run that fell behind shows; a load that must keep
its rate however slow the answers get (a disruption, an overload) is the Python client's. Two
layouts, and the same ``LoadResult`` as the Python loops':

* paced (the default): one thread, ``rate x CONNECTION_S`` connections, which by Little's law are
  all busy only when the mean latency passes 250 ms. The Lua callbacks do not say which
  connection they serve, so a send is not paired with its answer: statuses are counted by code,
  and latencies are wrk's histogram of every answer, from its actual send (wrk adds, below each
  answer slower than twice a connection's mean interval, samples an interval apart: its own
  correction for the sends that connection held back);
* ``timeline=True``: one connection a thread (``rate x TIMELINE_CONNECTION_S``), whose
  ``delay()``, ``request()`` and ``response()`` then follow each other: each request is recorded
  (its arrival, send and answer on the clock of Python's ``time.perf_counter``, its status), its
  latency counts from its arrival (200s and 503s apart), and ``events`` is the run's timeline.
  Each connection has its own arrivals, 10 a second on average: one that comes while it waits for
  an answer is sent late, its wait counted. Threads' wake-ups cost more: about 2.5 times the CPU a
  request (0.31-0.34 cores at 1,800-2,500 requests/s, against 0.11-0.14 paced and 0.64-0.77 for
  the Python client, on a busy machine).

A request in flight when wrk stops is not counted.

    result = run_wrk_open(url, headers, traffic, rate=2000, duration_s=60)
    with WrkBackgroundLoad(url, headers, traffic, rate=2000, timeline=True) as load:
        ...                                          # act on the server
    load.result.events                               # [(sent, answered, status)]
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from benchmarks.load import LoadResult, latency_percentiles
from benchmarks.traffic import Traffic
from benchmarks.wrk import READ_REQUESTS, WrkProcess, mean_items

# connections per request/s: paced, sockets of one thread, all busy only when the mean latency
# passes 250 ms (2.5 admission targets); with a timeline a thread each, every 100 ms on average
CONNECTION_S, TIMELINE_CONNECTION_S = 0.25, 0.1
MIN_CONNECTIONS, MAX_CONNECTIONS = 2, 512
LATE_S = 0.01  # a send this much after its schedule is late (wrk's timers have 1 ms steps)
START_S = 0.1  # from wrk's start to the first arrival: its threads are made one after another
START_S_PER_THREAD = 0.002
MAX_BACKGROUND_S = 3600.0

# The arrivals of a thread are Poisson at its share of the rate; a connection that is free claims
# the next one (delay() returns the wait for it). Each thread counts its late sends and its
# answers by status in globals that done() (the main state) reads: wrk copies numbers and strings
# between states (its copy of a table pops one value too many off the thread's stack). With a
# timeline (one connection a thread: a send is then paired with its answer), each thread also
# writes "scheduled sent answered status" a line to FOLDER/events-ID; paced, "answered status" of
# each answer other than a 200 to FOLDER/refused-ID. stdio's buffers are written out when wrk exits.
_SCRIPT = READ_REQUESTS + """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } open_loop_timespec;
int clock_gettime(int clock, open_loop_timespec *now);
]]
local timespec = ffi.new("open_loop_timespec")

local function now()  -- CLOCK_MONOTONIC (1): Python's time.perf_counter
  ffi.C.clock_gettime(1, timespec)
  return tonumber(timespec.tv_sec) + tonumber(timespec.tv_nsec) * 1e-9
end

local threads = {}  -- the main state's

function setup(thread)
  threads[#threads + 1] = thread
  thread:set("id", #threads)
end

-- a thread's; the globals are what done() reads: "status_CODE" and codes ("200 503 ...") too
late, last_sent, codes = 0, 0, ""
local requests, at, mean_gap, due, out, refused, running = {}, 0, 0, 0, nil, nil, false
local claimed, first, after = {}, 1, 1  -- arrivals claimed by a connection, not sent yet
local pending_scheduled, pending_sent = nil, nil  -- with a timeline: the request in flight
local keys = {}

local function gap()
  return -math.log(1 - math.random()) * mean_gap
end

function init(args)  -- FOLDER/bodies, this thread's rate, seed, threads, first arrival's time, timeline
  local all = read_requests(args[1])
  for n = (id - 1) % #all + 1, #all, tonumber(args[4]) do requests[#requests + 1] = all[n] end
  mean_gap = 1 / tonumber(args[2])
  math.randomseed(tonumber(args[3]) * 100003 + id)
  due = tonumber(args[5]) + gap()
  local folder = args[1]:match("^(.*)/[^/]*$")
  if args[6] == "1" then
    out = assert(io.open(folder .. "/events-" .. id, "w"))
    out:setvbuf("full", 65536)
  else
    refused = assert(io.open(folder .. "/refused-" .. id, "w"))
  end
  collectgarbage()
end

function delay()
  running = true
  claimed[after] = due
  after = after + 1
  local wait = due - now()
  due = due + gap()
  return math.max(0, wait * 1000)  -- whole milliseconds: wrk drops the fraction
end

local function record(answered, status)
  out:write(string.format("%.6f %.6f %.6f %d\\n", pending_scheduled, pending_sent, answered, status))
  pending_sent = nil
end

function request()
  if not running then return requests[1] end  -- wrk's check of the script, before the run
  local t = now()
  local scheduled = t  -- a reconnection sends without a delay()
  if first < after then
    scheduled = claimed[first]
    claimed[first] = nil
    first = first + 1
  end
  last_sent = t
  if t - scheduled >= LATE_S then late = late + 1 end
  if out then
    if pending_sent then record(t, 0) end  -- its connection broke before the answer
    pending_scheduled, pending_sent = scheduled, t
  end
  at = at % #requests + 1
  return requests[at]
end

function response(status, headers, body)
  local key = keys[status]
  if key == nil then
    key = "status_" .. status
    keys[status], codes, _G[key] = key, codes .. " " .. status, 0
  end
  _G[key] = _G[key] + 1
  if pending_sent then record(now(), status) end
  if refused and status ~= 200 then refused:write(string.format("%.6f %d\\n", now(), status)) end
end

function done(summary, latency, requests)
  local statuses, late, last = {}, 0, 0
  for _, thread in ipairs(threads) do
    for code in thread:get("codes"):gmatch("%d+") do
      statuses[code] = (statuses[code] or 0) + thread:get("status_" .. code)
    end
    late, last = late + thread:get("late"), math.max(last, thread:get("last_sent"))
  end
  local counts = {}
  for code, n in pairs(statuses) do counts[#counts + 1] = string.format('"%s": %d', code, n) end
  local e = summary.errors
  io.write(string.format(
    '{"late": %d, "last_sent": %.6f, "statuses": {%s}, "connect": %d, "read": %d, ' ..
    '"write": %d, "answered": %d, "p50": %d, "p90": %d, "p99": %d, "p99.9": %d, "mean": %f}\\n',
    late, last, table.concat(counts, ", "), e.connect, e.read, e.write, summary.requests,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
    latency.mean))
end
""".replace("LATE_S", repr(LATE_S))


def connections_for(rate: float, timeline: bool = False) -> int:
    """Enough connections that each sends every ``CONNECTION_S`` seconds on average
    (``TIMELINE_CONNECTION_S`` with a timeline)."""
    share = TIMELINE_CONNECTION_S if timeline else CONNECTION_S
    return min(MAX_CONNECTIONS, max(MIN_CONNECTIONS, math.ceil(rate * share)))


class WrkBackgroundLoad:
    """An open loop at ``rate`` from ``wrk`` until ``stop()`` (at most ``max_s``), which returns
    its result; ``__enter__`` returns at its first arrival. Used as ``BackgroundLoad`` is:

        with WrkBackgroundLoad(url, headers, traffic, rate=200, timeline=True) as load:
            ...                                  # act on the server
        load.result.events                       # [(sent, answered, status)] (timeline only)
    """

    def __init__(
        self, url: str, headers: dict, traffic: Traffic, rate: float, timeline: bool = False,
        max_s: float = MAX_BACKGROUND_S, seed: int = 0,
    ) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be positive, not {rate}")
        self.url, self.headers, self.traffic, self.rate = url, headers, traffic, rate
        self.timeline, self.max_s, self.seed = timeline, max_s, seed
        self.start_at = 0.0  # the first arrivals' time (time.perf_counter)
        self.result: LoadResult | None = None
        self._run: WrkProcess | None = None

    def __enter__(self) -> "WrkBackgroundLoad":
        connections = connections_for(self.rate, self.timeline)
        threads = connections if self.timeline else 1
        self.start_at = time.perf_counter() + START_S + START_S_PER_THREAD * threads
        arguments = (f"{self.rate / threads!r}", str(self.seed), str(threads), f"{self.start_at:.6f}",
                     "1" if self.timeline else "0")
        self._run = WrkProcess(
            _SCRIPT, self.url, self.headers, self.traffic, threads, connections, self.max_s, arguments)
        while time.perf_counter() < self.start_at:
            if self._run.process.poll() is not None:
                self._run.__exit__()
                raise RuntimeError(f"wrk exited with {self._run.process.returncode} before sending")
            time.sleep(0.005)
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.stop()
        elif self._run is not None:
            self._run.__exit__()

    def stop(self) -> LoadResult:
        if self.result is None:
            if self._run is None:
                raise RuntimeError("stop() before the load started")
            with self._run as run:
                self.result = self._result(run)
        return self.result

    def _result(self, run: WrkProcess) -> LoadResult:
        figures, cpu_s = run.finish(interrupt=True)
        wall_s = max(figures["last_sent"] - self.start_at, 1e-3)  # the arrivals' span
        # answers by status; broken connections as run_wrk counts them (a request each at most)
        errors = {f"connection_{k}": figures[k] for k in ("connect", "read", "write") if figures[k]}
        statuses = {**figures["statuses"], **errors}
        latency_ms = {k: figures[k] / 1000 for k in ("p50", "p90", "p99", "p99.9", "mean")}
        if not figures["answered"]:
            latency_ms = {}
        rejected_ms: dict[str, float] = {}
        events: list[tuple[float, float, str]] = []
        if self.timeline:  # each request's latency from its schedule, 200s and 503s apart
            scheduled, sent, answered, status = _records(run)
            start = np.minimum(scheduled, sent)  # sent early: wrk's timers round down to the millisecond
            latency_ms = latency_percentiles((answered - start)[status == 200])
            rejected_ms = latency_percentiles((answered - start)[status == 503])
            labels = [str(code) if code else "connection_error" for code in status.tolist()]
            events = list(zip(start.tolist(), answered.tolist(), labels))
        return LoadResult(
            mode="open",
            level=self.rate,
            wall_s=wall_s,
            requests=sum(statuses.values()),
            items=mean_items(self.traffic, statuses.get("200", 0)),
            statuses=statuses,
            latency_ms=latency_ms,
            client_cpu_cores=cpu_s / wall_s,
            rejected_latency_ms=rejected_ms,
            client="wrk",
            client_threads=min(run.threads, os.cpu_count() or 1),
            late_sends=figures["late"],
            events=events,
            refused=_refused(run),
        )


def run_wrk_open(
    url: str, headers: dict, traffic: Traffic, rate: float, duration_s: float, timeline: bool = False,
    seed: int = 0,
) -> LoadResult:
    """Poisson arrivals at ``rate`` requests/s for ``duration_s`` seconds."""
    with WrkBackgroundLoad(url, headers, traffic, rate, timeline, duration_s + 10, seed) as load:
        time.sleep(max(0.0, load.start_at + duration_s - time.perf_counter()))
    assert load.result is not None
    return load.result


def _records(run: WrkProcess) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(scheduled, sent, answered, status) of every recorded request, in order of schedule."""
    text = b"".join(path.read_bytes() for path in sorted(run.folder.glob("events-*")))
    table = np.fromstring(text, sep=" ").reshape(-1, 4) if text.strip() else np.zeros((0, 4))
    table = table[np.argsort(table[:, 0], kind="stable")]
    return table[:, 0], table[:, 1], table[:, 2], table[:, 3].astype(np.int64)


def _refused(run: WrkProcess) -> list[tuple[float, int]]:
    """(answered, status) of every answer other than a 200 of a paced run, in time order."""
    lines = b"".join(path.read_bytes() for path in run.folder.glob("refused-*")).split()
    return sorted((float(at), int(status)) for at, status in zip(lines[::2], lines[1::2]))
