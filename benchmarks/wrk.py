"""The compiled closed-loop client: ``wrk`` (the distribution's package; ``make bench`` installs it)
driven by a Lua script that cycles through the traffic's request bodies.

On two cores the Python client saturates near 4,000 requests/s, below TorchServe's own no-op floor
(about 10,000 one-item requests/s at concurrency 32): closed-loop serving points use ``wrk``, and
the Python client stays for open-loop, mixed and fault scenarios. Like the Python client's, each
result carries the client's CPU (cores, from the kernel's accounting of the ``wrk`` process), and
is marked saturated when the client used at least 90% of the cores its threads can use.

    result = run_wrk(url, headers, traffic, concurrency=32, duration_s=10)   # a LoadResult
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import orjson

from benchmarks.load import LoadResult, check_loopback
from benchmarks.traffic import Traffic
from handlers.runtime.wire.v2_headers import HEADER_LENGTH

WRK_THREADS = 1  # one thread sends ~25,000 requests/s here: the server is the bottleneck long before

# Each record of the bodies file: "<body length> <JSON header length or -1>\n<body>". The script
# pre-formats every request once (wrk.format) and hands them out in turn; done() prints the figures
# as one JSON line (latencies in microseconds).
_SCRIPT = """
local requests = {}
local next_request = 0

function init(args)
  local file = assert(io.open(args[1], "rb"))
  local data = file:read("*a")
  file:close()
  local at = 1
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
""".replace("HEADER_LENGTH", HEADER_LENGTH)


def wrk_path() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise FileNotFoundError(
            "wrk is not installed: `make bench` installs it (apt-get install wrk), or install it yourself"
        )
    return found


def run_wrk(
    url: str, headers: dict, traffic: Traffic, concurrency: int, duration_s: float, offset: int = 0
) -> LoadResult:
    """A closed loop of ``concurrency`` connections for ``duration_s`` seconds, each sending the
    traffic's bodies in turn (from ``offset``). Latencies are of every answered request; ``items``
    counts the items of the 2xx answers (the traffic's mean items per request times their number)."""
    check_loopback(url)
    with tempfile.TemporaryDirectory(prefix="wrk-") as folder:
        script, bodies = Path(folder) / "traffic.lua", Path(folder) / "bodies"
        script.write_text(_SCRIPT)
        _write_bodies(traffic, bodies)
        command = [
            wrk_path(), f"-t{WRK_THREADS}", f"-c{concurrency}", f"-d{max(1, round(duration_s))}s",
            "--timeout", "30s", "-s", str(script),
            *(arg for name, value in headers.items() for arg in ("-H", f"{name}: {value}")),
            url, "--", str(bodies), str(offset),
        ]
        with open(Path(folder) / "out", "w+b") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            printed = out.read().decode(errors="replace")
    if process.returncode != 0 or not printed.strip() or not printed.strip().splitlines()[-1].startswith("{"):
        raise RuntimeError(f"wrk failed ({process.returncode}):\n{printed[-2000:]}")
    figures = orjson.loads(printed.strip().splitlines()[-1])
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
        items=round(ok * sum(traffic.items) / len(traffic.items)),
        statuses=statuses,
        latency_ms={k: figures[k] / 1000 for k in ("p50", "p90", "p99", "p99.9", "mean")},
        client_cpu_cores=(usage.ru_utime + usage.ru_stime) / wall_s,
        client="wrk",
        client_threads=WRK_THREADS,
    )


def _write_bodies(traffic: Traffic, path: Path) -> None:
    lengths = traffic.header_lengths or [-1] * len(traffic.bodies)
    with open(path, "wb") as file:
        for body, header_length in zip(traffic.bodies, lengths):
            file.write(b"%d %d\n" % (len(body), header_length))
            file.write(body)
