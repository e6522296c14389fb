"""The compiled closed-loop client: ``wrk`` (the distribution's package; ``make bench`` installs it)
driven by a Lua script that cycles through the traffic's request bodies.

On two cores the Python client saturates near 4,000 requests/s, below TorchServe's own no-op floor
(about 10,000 one-item requests/s at concurrency 32): closed-loop serving points use ``wrk``, and
so do the reliability and freshness scenarios' open loops (``benchmarks.wrk_open``, on the pieces
below). Like the Python client's, each result carries the client's CPU (cores, from the kernel's
accounting of the ``wrk`` process), and is marked saturated when the client used at least 90% of
the cores its threads can use.

    result = run_wrk(url, headers, traffic, concurrency=32, duration_s=10)   # a LoadResult
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import orjson

from benchmarks.load import LoadResult, check_loopback
from benchmarks.traffic import Traffic
from handlers.runtime.wire.v2_headers import HEADER_LENGTH

INTERRUPT_TIMEOUT_S = 30.0
WRK_THREADS = 1  # one thread sends ~25,000 requests/s here: the server is the bottleneck long before

# Each record of the bodies file: "<body length> <JSON header length or -1>\n<body>". read_requests
# pre-formats every request once (wrk.format), in the file's order.
READ_REQUESTS = """
function read_requests(path)
  local file = assert(io.open(path, "rb"))
  local data = file:read("*a")
  file:close()
  local requests, at = {}, 1
  while at <= #data do
    local newline = data:find("\\n", at, true)
    local length, header_length = data:sub(at, newline - 1):match("^(%d+) (%-?%d+)$")
    length, header_length = tonumber(length), tonumber(header_length)
    local headers = {}
    for name, value in pairs(wrk.headers) do headers[name] = value end
    if header_length >= 0 then
      headers["Content-Type"] = "application/octet-stream"
      headers["HEADER_LENGTH"] = tostring(header_length)
    else
      headers["Content-Type"] = "application/json"
    end
    requests[#requests + 1] = wrk.format("POST", nil, headers, data:sub(newline + 1, newline + length))
    at = newline + 1 + length
  end
  return requests
end
""".replace("HEADER_LENGTH", HEADER_LENGTH)

# The closed loop: the requests handed out in turn; done() prints the figures as one JSON line
# (latencies in microseconds).
_SCRIPT = READ_REQUESTS + """
local requests = {}
local next_request = 0

function init(args)
  requests = read_requests(args[1])
  next_request = tonumber(args[2]) % #requests
end

function request()
  next_request = next_request % #requests + 1
  return requests[next_request]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "non_2xx": %d, "connect": %d, "read": %d, "write": %d, ' ..
    '"timeout": %d, "p50": %d, "p90": %d, "p99": %d, "p99.9": %d, "mean": %f}\\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
    latency.mean))
end
"""


def wrk_path() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise FileNotFoundError(
            "wrk is not installed: `make bench` installs it (apt-get install wrk), or install it yourself"
        )
    return found


class WrkProcess:
    """``wrk`` running ``script`` against ``url`` from a folder of its own, its arguments the
    traffic's bodies file there then ``args``, until its duration ends or ``finish(interrupt=True)``:

        with WrkProcess(script, url, headers, traffic, 1, 32, 10.0) as run:
            figures, cpu_s = run.finish()     # done()'s JSON line, wrk's CPU seconds (every thread)
            run.folder                        # what the script wrote, until the block ends
    """

    def __init__(
        self, script: str, url: str, headers: dict, traffic: Traffic, threads: int, connections: int,
        duration_s: float, args: tuple[str, ...] = (),
    ) -> None:
        check_loopback(url)
        self.threads = threads
        self._folder = tempfile.TemporaryDirectory(prefix="wrk-")
        self.folder = Path(self._folder.name)
        (self.folder / "script.lua").write_text(script)
        _write_bodies(traffic, self.folder / "bodies")
        command = [
            wrk_path(), f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration_s))}s",
            "--timeout", "30s", "-s", str(self.folder / "script.lua"),
            *(arg for name, value in headers.items() for arg in ("-H", f"{name}: {value}")),
            url, "--", str(self.folder / "bodies"), *args,
        ]
        self._out = open(self.folder / "out", "w+b")
        self.process = subprocess.Popen(command, stdout=self._out, stderr=subprocess.STDOUT)

    def __enter__(self) -> "WrkProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.returncode is None:  # an error on the way: not left running
            self.process.kill()
            self.process.wait()
        self._out.close()
        self._folder.cleanup()

    def finish(self, interrupt: bool = False) -> tuple[dict, float]:
        """Waits for wrk's end: its duration's, or (``interrupt``) now, by SIGINT as Ctrl-C would.
        wrk ignores SIGINT until all its threads are created: sent again each second until it ends."""
        if interrupt:
            started, signalled = time.monotonic(), -1.0
            while not (ended := os.wait4(self.process.pid, os.WNOHANG))[0]:
                now = time.monotonic()
                if now > started + INTERRUPT_TIMEOUT_S:
                    raise RuntimeError(f"wrk did not stop within {INTERRUPT_TIMEOUT_S} s of SIGINT")
                if now >= signalled + 1.0:  # os.kill: Popen's send_signal could reap it before wait4
                    os.kill(self.process.pid, signal.SIGINT)
                    signalled = now
                time.sleep(0.02)
            _, status, usage = ended
        else:
            _, status, usage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self._out.seek(0)
        printed = self._out.read().decode(errors="replace").strip()
        if self.process.returncode != 0 or not printed or not printed.splitlines()[-1].startswith("{"):
            raise RuntimeError(f"wrk failed ({self.process.returncode}):\n{printed[-2000:]}")
        return orjson.loads(printed.splitlines()[-1]), usage.ru_utime + usage.ru_stime


def run_wrk(
    url: str, headers: dict, traffic: Traffic, concurrency: int, duration_s: float, offset: int = 0
) -> LoadResult:
    """A closed loop of ``concurrency`` connections for ``duration_s`` seconds, each sending the
    traffic's bodies in turn (from ``offset``). Latencies are of every answered request; ``items``
    counts the items of the 2xx answers (the traffic's mean items per request times their number)."""
    arguments = (str(offset),)
    with WrkProcess(_SCRIPT, url, headers, traffic, WRK_THREADS, concurrency, duration_s, arguments) as run:
        figures, cpu_s = run.finish()
    wall_s = figures["duration_us"] / 1e6
    ok = figures["requests"] - figures["non_2xx"]
    # wrk tells answers below 400 ("200": our handler answers nothing else) from the rest
    errors = {"non_2xx": figures["non_2xx"], **{f"connection_{k}": figures[k] for k in ("connect", "read", "write", "timeout")}}
    statuses = {"200": ok, **{k: v for k, v in errors.items() if v}}
    return LoadResult(
        mode="closed",
        level=concurrency,
        wall_s=wall_s,
        requests=figures["requests"],
        items=mean_items(traffic, ok),
        statuses=statuses,
        latency_ms={k: figures[k] / 1000 for k in ("p50", "p90", "p99", "p99.9", "mean")},
        client_cpu_cores=cpu_s / wall_s,
        client="wrk",
        client_threads=WRK_THREADS,
    )


def mean_items(traffic: Traffic, requests: int) -> int:
    """The items of ``requests`` requests of ``traffic``: wrk does not say which bodies they were."""
    return round(requests * sum(traffic.items) / len(traffic.items))


def _write_bodies(traffic: Traffic, path: Path) -> None:
    lengths = traffic.header_lengths or [-1] * len(traffic.bodies)
    with open(path, "wb") as file:
        for body, header_length in zip(traffic.bodies, lengths):
            file.write(b"%d %d\n" % (len(body), header_length))
            file.write(body)
