"""The reliability suite: the real TorchServe, with the project's configuration and plugin, serving
the real model, put through what production does to a server.

    make bench SCENARIO=reliability          # Criteo-shaped model, 10-minute soak (~25 min)
    make bench SCENARIO=reliability-smoke    # tiny model, seconds per phase (the test suite runs it)

Writes ``benchmarks/results/SCENARIO/reliability.json`` (the keys below), ``summary.txt`` and
``disruptions.png`` (each request of the disruption phases: latency against time, by status):

* ``max_load_rps``: the highest open-loop rate of one-item requests served with no error and a
  p99 within 4x that of a light load (at least 50 ms), in steps of 5% of a closed loop's
  throughput (the load generator shares the 2 cores); the phases below run at fractions of it;
* ``soak_s``, ``soak_requests``, ``soak_errors``, ``soak_rss_growth_pct``: an open loop at 80% of
  the max load; RSS of the frontend and workers, after the first tenth against the end;
* ``kill_worker_failed_requests``, ``kill_worker_inflight``, ``kill_worker_recovery_s``: one of two
  workers killed with SIGKILL under load; failed requests against those in flight when the death
  showed (sent before its first failed answer, answered after the kill); recovery: kill -> both
  workers ready again;
* ``scale_down_lost_requests``: 1 -> 2 -> 1 workers, ``trials`` times under load: requests left
  unanswered or failed (a 503 of admission control, shed while a new worker takes a core to load,
  is counted apart: ``scale_down_shed_requests``);
* ``hung_worker_detect_s`` (SIGSTOP -> /ping names the worker), ``hung_worker_failed_requests``;
* ``overload_2x_accepted_p99_ms``, ``overload_2x_reject_p99_ms``, ``inference_p99_ms_unloaded``:
  100-candidate requests (batch_size 3: one thread per forward) at twice the measured capacity,
  against 10% of it; the wait target is the unloaded median latency (``max_queue_wait_ms`` at
  register);
* ``register_during_load_inference_p99_ms``, ``inference_p99_ms_baseline``: 50% load while a
  second model registers synchronously, against the same load without;
* ``version_swap_failed_requests``: register version 2.0, set it default, unregister 1.0, under load;
* ``fuzz_cases``, ``fuzz_5xx``: mutated bodies (truncated, wrong types, huge values, duplicate
  keys, bad encodings, ...), and whether the worker stayed up;
* ``token_expiry_client_errors``: a server whose keys expire every 3 s, served for 10 key lifetimes
  by the project's client;
* ``log_bytes_per_hour_at_1k_rps``: log growth at 1,000 requests/s, per hour.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import orjson  # noqa: E402
import psutil  # noqa: E402
import requests  # noqa: E402
from tqdm import tqdm  # noqa: E402

from archive_tools.local_server import LocalTorchServe  # noqa: E402
from benchmarks.load import BackgroundLoad, LoadResult, run_closed_loop, run_open_loop  # noqa: E402
from benchmarks.memory import model_workers  # noqa: E402
from benchmarks.scenarios import CRITEO_CANDIDATE_FEATURES, MODELS  # noqa: E402
from benchmarks.traffic import Traffic, TrafficModel  # noqa: E402
from handlers.modeling.registry import load_spec  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ReliabilityScenario:
    name: str
    spec: Path
    build_args: tuple[str, ...]
    soak_s: float
    phase_s: float  # load around each disruption
    scale_trials: int
    fuzz_cases: int
    overload_s: float
    log_s: float
    log_rate: float  # requests/s of the log measurement (scaled to 1,000/s)
    candidate_features: tuple[str, ...]


RELIABILITY_SCENARIOS = {
    "reliability": ReliabilityScenario(
        "reliability", MODELS / "criteo.yaml", ("--artifact", "aoti"),
        soak_s=600.0, phase_s=8.0, scale_trials=20, fuzz_cases=2000, overload_s=20.0,
        log_s=60.0, log_rate=1000.0, candidate_features=CRITEO_CANDIDATE_FEATURES,
    ),
    "reliability-smoke": ReliabilityScenario(
        "reliability-smoke", MODELS / "tiny.yaml", (),
        soak_s=8.0, phase_s=3.0, scale_trials=2, fuzz_cases=150, overload_s=4.0,
        log_s=4.0, log_rate=200.0, candidate_features=("item_id",),
    ),
}


def run_reliability(scenario: ReliabilityScenario, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = load_spec(scenario.spec)
    one_item = TrafficModel(items_per_request=1).generate(spec, 512, seed=1)
    candidates = TrafficModel(
        items_per_request=100, candidate_features=scenario.candidate_features
    ).generate(spec, 128, seed=2)
    store = out_dir / "model_store"
    shutil.rmtree(store, ignore_errors=True)
    for version in ("1.0", "2.0"):
        _build(scenario, store / version, version)
    name = spec.name
    figures: dict = {"scenario": scenario.name}
    timelines: dict[str, tuple[LoadResult, float]] = {}
    phases = tqdm(total=11, desc=scenario.name, unit="phase")

    def phase(label: str) -> None:
        phases.set_postfix_str(label)
        phases.update()

    with LocalTorchServe(model_store=store / "1.0") as server:
        url = f"{server.inference_url}/predictions/{name}"
        auth = server.auth("inference")
        ok(server.register(f"{name}.mar", batch_size=32, max_batch_delay=5))
        run_closed_loop(url, auth, one_item, 8, 2.0, 10**6)  # warm-up
        figures.update(max_load(url, auth, one_item, scenario.phase_s))
        max_rps = figures["max_load_rps"]
        phase("max load")

        baseline = run_open_loop(url, auth, one_item, 0.5 * max_rps, scenario.phase_s)
        figures["inference_p99_ms_baseline"] = baseline.latency_ms["p99"]
        with BackgroundLoad(url, auth, one_item, 0.5 * max_rps) as load:
            time.sleep(1.0)
            ok(server.register(f"{name}.mar", model_name=f"{name}-second", initial_workers=1))
            time.sleep(1.0)
        figures["register_during_load_inference_p99_ms"] = load.result.latency_ms["p99"]
        figures["register_during_load_non_200"] = _failed(load.result)
        ok(server.management("DELETE", f"/models/{name}-second"))
        phase("register during load")

        figures.update(_soak(server, url, auth, one_item, 0.8 * max_rps, scenario.soak_s))
        phase("soak")

        ok(server.management("PUT", f"/models/{name}", params={"min_worker": 2, "synchronous": "true"}))
        kill, kill_at, kill_figures = _kill_worker(server, name, url, auth, one_item, 0.5 * max_rps, scenario.phase_s)
        figures.update(kill_figures)
        timelines["kill -9 one of two workers"] = (kill, kill_at)
        phase("kill a worker")

        hung, hung_at, hung_figures = _hang_worker(server, name, url, auth, one_item, 0.3 * max_rps, scenario.phase_s)
        figures.update(hung_figures)
        timelines["SIGSTOP one of two workers"] = (hung, hung_at)
        phase("hang a worker")

        ok(server.management("PUT", f"/models/{name}", params={"min_worker": 1, "synchronous": "true"}))
        scale, scale_at = _scale_down_trials(server, name, url, auth, one_item, 0.3 * max_rps, scenario.scale_trials)
        figures["scale_down_trials"] = scenario.scale_trials
        figures["scale_down_lost_requests"] = _failed(scale) - scale.statuses.get("503", 0)
        figures["scale_down_shed_requests"] = scale.statuses.get("503", 0)
        figures["scale_down_statuses"] = scale.statuses
        timelines[f"scale 1 -> 2 -> 1 workers, {scenario.scale_trials} times"] = (scale, scale_at)
        phase("scale down")

        figures.update(_fuzz(server, name, one_item, scenario.fuzz_cases))
        phase("fuzz")

        figures.update(_logs(server, url, auth, one_item, scenario.log_rate, scenario.log_s))
        phase("logs")

        figures.update(_overload(server, name, candidates, scenario.phase_s, scenario.overload_s))
        phase("overload")

        (store / "1.0" / f"{name}-v2.mar").symlink_to((store / "2.0" / f"{name}.mar").resolve())
        swap, swap_at = _version_swap(server, name, url, auth, one_item, 0.5 * max_rps)
        figures["version_swap_failed_requests"] = _failed(swap)
        figures["version_swap_statuses"] = swap.statuses
        timelines["version 1.0 -> 2.0 (register, set-default, unregister)"] = (swap, swap_at)
        phase("version swap")

    figures.update(_token_expiry(store / "1.0", name, one_item))
    phase("token expiry")
    phases.close()

    (out_dir / "reliability.json").write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
    (out_dir / "summary.txt").write_text(_summary(figures))
    _plot(timelines, out_dir / "disruptions.png")
    print(_summary(figures))
    return figures


# -- phases ---------------------------------------------------------------------------------------


def max_load(url: str, auth: dict, traffic: Traffic, seconds: float) -> dict:
    """The highest open-loop rate the server sustains: every request answered 200 with a p99
    within 4x that of a light load (at least 50 ms). Rates step up by 5% of a closed loop's
    throughput (32 senders), from 20%; the load generator shares the machine's cores, so what it
    can send is part of the limit. A step that misses is run once more before the search ends:
    one stall of the machine itself (``benchmarks.stalls``: 20-250 ms now and then, at any load)
    is enough to lift a short step's p99 past the bound: two searches here ended on steps at
    25% and 30% of the closed loop's rate (p99 128 and 94 ms), where earlier ones reached 80%."""
    closed_rps = run_closed_loop(url, auth, traffic, 32, seconds, 10**7).requests_per_s
    light = run_open_loop(url, auth, traffic, 0.2 * closed_rps, seconds)
    bound_ms = max(50.0, 4 * light.latency_ms["p99"])
    sustained = 0.2 * closed_rps
    steps = {}

    def missed(result: LoadResult) -> bool:
        return bool(_failed(result)) or result.latency_ms["p99"] > bound_ms

    for twentieths in range(5, 21):
        rate = twentieths / 20 * closed_rps
        result = run_open_loop(url, auth, traffic, rate, seconds)
        if missed(result):
            result = run_open_loop(url, auth, traffic, rate, seconds)
        steps[f"{rate:.0f}"] = {"p99_ms": result.latency_ms.get("p99"), "statuses": result.statuses}
        if missed(result):
            break
        sustained = rate
    return {
        "closed_loop_rps": closed_rps,
        "light_load_p99_ms": light.latency_ms["p99"],
        "max_load_steps": steps,
        "max_load_rps": sustained,
    }


def _soak(server: LocalTorchServe, url: str, auth: dict, traffic: Traffic, rate: float, seconds: float) -> dict:
    with BackgroundLoad(url, auth, traffic, rate) as load:
        time.sleep(seconds / 10)
        early = _server_rss_mib(server)
        time.sleep(seconds * 9 / 10)
        late = _server_rss_mib(server)
    result = load.result
    return {
        "soak_s": seconds,
        "soak_rate_rps": rate,
        "soak_requests": result.requests,
        "soak_errors": _failed(result),
        "soak_statuses": result.statuses,
        "soak_p99_ms": result.latency_ms.get("p99"),
        "soak_rss_mib": [early, late],
        "soak_rss_growth_pct": 100 * (late - early) / early,
    }


def _kill_worker(
    server: LocalTorchServe, name: str, url: str, auth: dict, traffic: Traffic, rate: float, seconds: float
) -> tuple[LoadResult, float, dict]:
    with BackgroundLoad(url, auth, traffic, rate) as load:
        time.sleep(seconds / 2)
        victim = _ready_pids(server, name)[-1]
        killed_at = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        recovered_at = _wait(lambda: _recovered(server, name, victim, 2), 120)
        time.sleep(seconds / 2)
    result = load.result
    failures = [answered for sent, answered, status in result.events if status != "200" and answered > killed_at]
    shown_at = min(failures, default=killed_at)
    in_flight = sum(1 for sent, answered, _ in result.events if sent <= shown_at and answered >= killed_at)
    return result, killed_at, {
        "kill_worker_failed_requests": _failed(result),
        "kill_worker_statuses": result.statuses,
        "kill_worker_inflight": in_flight,
        "kill_worker_recovery_s": recovered_at - killed_at,
    }


def _hang_worker(
    server: LocalTorchServe, name: str, url: str, auth: dict, traffic: Traffic, rate: float, seconds: float
) -> tuple[LoadResult, float, dict]:
    with BackgroundLoad(url, auth, traffic, rate) as load:
        time.sleep(seconds / 2)
        victim = _ready_pids(server, name)[-1]
        stopped_at = time.perf_counter()
        os.kill(victim, signal.SIGSTOP)
        detected_at = _wait(lambda: "stopped answering" in _ping(server), 60, every_s=0.05)
        recovered_at = _wait(lambda: _recovered(server, name, victim, 2), 120)
        time.sleep(seconds / 2)
    result = load.result
    return result, stopped_at, {
        "hung_worker_detect_s": detected_at - stopped_at,
        "hung_worker_recovery_s": recovered_at - stopped_at,
        "hung_worker_failed_requests": _failed(result),
        "hung_worker_statuses": result.statuses,
    }


def _scale_down_trials(
    server: LocalTorchServe, name: str, url: str, auth: dict, traffic: Traffic, rate: float, trials: int
) -> tuple[LoadResult, float]:
    with BackgroundLoad(url, auth, traffic, rate) as load:
        started = time.perf_counter()
        for _ in range(trials):
            ok(server.management("PUT", f"/models/{name}", params={"min_worker": 2, "synchronous": "true"}))
            time.sleep(0.5)
            ok(server.management("PUT", f"/models/{name}", params={"min_worker": 1, "synchronous": "true"}))
            time.sleep(0.5)
    return load.result, started


def _version_swap(
    server: LocalTorchServe, name: str, url: str, auth: dict, traffic: Traffic, rate: float
) -> tuple[LoadResult, float]:
    with BackgroundLoad(url, auth, traffic, rate) as load:
        time.sleep(1.0)
        started = time.perf_counter()
        ok(server.register(f"{name}-v2.mar", initial_workers=1))
        ok(server.management("PUT", f"/models/{name}/2.0/set-default"))
        ok(server.management("DELETE", f"/models/{name}/1.0"))
        time.sleep(1.0)
    return load.result, started


def _overload(server: LocalTorchServe, name: str, traffic: Traffic, phase_s: float, overload_s: float) -> dict:
    """Worker-bound requests (100 candidates; 3 per batch keeps each forward on one thread, leaving
    a core to the frontend), so that the client can offer twice the capacity without taking the
    server's CPU."""
    ranking = f"{name}-ranking"
    url = f"{server.inference_url}/predictions/{ranking}"
    auth = server.auth("inference")
    batching = {"batch_size": 3, "max_batch_delay": 2}
    ok(server.register(f"{name}.mar", model_name=ranking, **batching))
    run_closed_loop(url, auth, traffic, 4, 1.0, 10**6)  # the worker's first batches
    capacity = run_closed_loop(url, auth, traffic, 8, phase_s, 10**6).requests_per_s
    unloaded = run_open_loop(url, auth, traffic, 0.1 * capacity, max(phase_s, 500 / (0.1 * capacity)))
    ok(server.management("DELETE", f"/models/{ranking}"))
    budget_ms = math.ceil(unloaded.latency_ms["p50"])
    ok(server.register(f"{name}.mar", model_name=ranking, max_queue_wait_ms=budget_ms, **batching))
    run_closed_loop(url, auth, traffic, 4, 1.0, 10**6)  # the new worker's first batches
    overload = run_open_loop(url, auth, traffic, 2 * capacity, overload_s)
    ok(server.management("DELETE", f"/models/{ranking}"))
    return {
        "overload_capacity_rps": capacity,
        "inference_p99_ms_unloaded": unloaded.latency_ms["p99"],
        "overload_max_queue_wait_ms": budget_ms,
        "overload_2x_statuses": overload.statuses,
        "overload_2x_served_rps": overload.requests_per_s,
        "overload_2x_accepted_p99_ms": overload.latency_ms.get("p99"),
        "overload_2x_reject_p99_ms": overload.rejected_latency_ms.get("p99"),
    }


def _fuzz(server: LocalTorchServe, name: str, traffic: Traffic, cases: int) -> dict:
    url = f"{server.inference_url}/predictions/{name}"
    pids = sorted(p.pid for p in model_workers(server.process.pid))
    statuses: dict[str, int] = {}
    with requests.Session() as session:
        for body, headers in fuzz_cases(traffic.bodies, cases, seed=0):
            response = session.post(url, data=body, headers={**headers, **server.auth("inference")}, timeout=60)
            key = str(response.status_code)
            statuses[key] = statuses.get(key, 0) + 1
    return {
        "fuzz_cases": cases,
        "fuzz_5xx": sum(n for code, n in statuses.items() if code.startswith("5")),
        "fuzz_statuses": statuses,
        "fuzz_worker_restarted": sorted(p.pid for p in model_workers(server.process.pid)) != pids,
    }


def _logs(server: LocalTorchServe, url: str, auth: dict, traffic: Traffic, rate: float, seconds: float) -> dict:
    logs = server.workdir / "logs"
    before = _folder_bytes(logs)
    result = run_open_loop(url, auth, traffic, rate, seconds)
    time.sleep(1.0)  # asynchronous appenders
    grown = _folder_bytes(logs) - before
    per_hour = grown / result.wall_s * 3600 * (1000.0 / rate)
    return {
        "log_bytes_per_hour_at_1k_rps": per_hour,
        "log_measured_rps": result.requests / result.wall_s,
        "log_files": sorted(p.name for p in logs.iterdir()),
    }


def _token_expiry(store: Path, name: str, traffic: Traffic) -> dict:
    lifetime_min = 0.05
    with LocalTorchServe(model_store=store, settings={"token_expiration_min": str(lifetime_min)}) as server:
        ok(server.register(f"{name}.mar"))
        deadline = time.perf_counter() + 10 * lifetime_min * 60
        errors = sent = 0
        while time.perf_counter() < deadline:
            sent += 1
            errors += server.predict(name, traffic.bodies[sent % len(traffic.bodies)]).status_code != 200
            time.sleep(0.02)
        return {
            "token_expiry_client_errors": errors,
            "token_expiry_requests": sent,
            "token_lifetime_s": lifetime_min * 60,
            "token_refreshes": server.keys.refreshes if server.keys else 0,
        }


# -- the fuzzer -----------------------------------------------------------------------------------


def fuzz_cases(bodies: list[bytes], count: int, seed: int) -> list[tuple[bytes, dict]]:
    """``count`` malformed requests, each (body, headers), mutated from the valid ``bodies``."""
    rng = random.Random(seed)
    json_headers = {"Content-Type": "application/json"}
    values = ["NaN", "Infinity", "-1", "1e400", "123456789012345678901234567890", '"x"', "null", "true",
              "[]", "{}", "[[[[1]]]]", "-0.0", '"\\u0000"', "1.5"]

    def mutate(body: bytes) -> tuple[bytes, dict]:
        kind = rng.randrange(10)
        text = body.decode()
        if kind == 0:  # truncated
            return body[: rng.randrange(len(body))], json_headers
        if kind == 1:  # random bytes flipped
            data = bytearray(body)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            return bytes(data), json_headers
        if kind in (2, 3):  # a number or list replaced by another JSON value
            spots = [i for i, c in enumerate(text) if c in "0123456789["]
            at = rng.choice(spots)
            end = at + 1
            while end < len(text) and text[end] not in ",]}":
                end += 1
            return (text[:at] + rng.choice(values) + text[end:]).encode(), json_headers
        if kind == 4:  # a key repeated, renamed, or unknown
            parsed = orjson.loads(body)
            key = rng.choice(list(parsed))
            return text.replace(f'"{key}"', f'"{key}x"', 1).encode() if rng.random() < 0.5 else (
                text[:-1] + f', "{key}": {orjson.dumps(parsed[key]).decode()}}}'
            ).encode(), json_headers
        if kind == 5:  # not an object
            return rng.choice([b"[]", b'"items"', b"42", b"null", b"", b" ", b"{", b"\xff\xfe"]), json_headers
        if kind == 6:  # nested beyond any parser's depth
            depth = rng.choice([100, 1000, 100_000])
            return b'{"items": ' + b"[" * depth + b"]" * depth + b"}", json_headers
        if kind == 7:  # a form, or no content type
            return body, rng.choice([{"Content-Type": "application/x-www-form-urlencoded"}, {}])
        if kind == 8:  # encodings
            encoding = rng.choice(["gzip", "br", "deflate"])
            data = gzip.compress(body) if encoding == "gzip" and rng.random() < 0.5 else body
            return data, {**json_headers, "Content-Encoding": encoding}
        items = orjson.loads(body).get("items", [{}])  # many items
        return orjson.dumps({"items": items * rng.choice([1000, 5000])}), json_headers

    return [mutate(bodies[rng.randrange(len(bodies))]) for _ in range(count)]


# -- helpers --------------------------------------------------------------------------------------


def _build(scenario: ReliabilityScenario, store: Path, version: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "archive_tools", "build", "--spec", str(scenario.spec), "--seed", "0",
         "--version", version, "--model-store", str(store), *scenario.build_args],
        check=True,
    )


def ok(response: requests.Response) -> requests.Response:
    """``response``, or an error naming the call when it is not a 200."""
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.method} {response.url}: {response.status_code} {response.text}")
    return response


def _failed(result: LoadResult) -> int:
    return sum(n for status, n in result.statuses.items() if status != "200")


def _wait(condition: Callable[[], bool], timeout_s: float, every_s: float = 0.1) -> float:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if condition():
            return time.perf_counter()
        time.sleep(every_s)
    raise TimeoutError(f"not within {timeout_s}s")


def _ping(server: LocalTorchServe) -> str:
    return requests.get(f"{server.inference_url}/ping", headers=server.auth("inference"), timeout=10).text


def _ready_pids(server: LocalTorchServe, name: str) -> list[int]:
    """The model's workers that TorchServe reports ready, by process id."""
    described = server.management("GET", f"/models/{name}").json()[0]
    return [worker["pid"] for worker in described["workers"] if worker["status"] == "READY"]


def _recovered(server: LocalTorchServe, name: str, victim: int, workers: int) -> bool:
    """``workers`` ready again, none of them the process that was killed or stopped."""
    ready = _ready_pids(server, name)
    return len(ready) == workers and victim not in ready


def _server_rss_mib(server: LocalTorchServe) -> float:
    """The frontend's and the workers' resident memory."""
    total = 0
    for process in [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# -- report ---------------------------------------------------------------------------------------

TARGETS = (  # (key, op, value or the key it is compared with, factor)
    ("scale_down_lost_requests", "<=", 0, 1),
    ("kill_worker_failed_requests", "<=", "kill_worker_inflight", 1),
    ("kill_worker_recovery_s", "<=", 10, 1),
    ("hung_worker_detect_s", "<=", 5, 1),
    ("overload_2x_reject_p99_ms", "<=", 10, 1),
    ("overload_2x_accepted_p99_ms", "<=", "inference_p99_ms_unloaded", 2),
    ("register_during_load_inference_p99_ms", "<=", "inference_p99_ms_baseline", 1.5),
    ("version_swap_failed_requests", "<=", 0, 1),
    ("soak_errors", "<=", 0, 1),
    ("soak_rss_growth_pct", "<=", 5, 1),
    ("fuzz_5xx", "<=", 0, 1),
    ("token_expiry_client_errors", "<=", 0, 1),
    ("log_bytes_per_hour_at_1k_rps", "<=", 50 * 2**20, 1),
)


def _summary(figures: dict) -> str:
    lines = [f"reliability scenario {figures['scenario']}"]
    for key, _, bound, factor in TARGETS:
        value = figures.get(key)
        limit = factor * (figures[bound] if isinstance(bound, str) else bound)
        met = value is not None and value <= limit
        label = f"{factor:g} x {bound}" if isinstance(bound, str) and factor != 1 else str(bound)
        lines.append(f"  {key:<40}{_fmt(value):>14}  target <= {label} ({_fmt(limit)}): {'met' if met else 'MISSED'}")
    return "\n".join(lines) + "\n"


def _fmt(value: object) -> str:
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def _plot(timelines: dict[str, tuple[LoadResult, float]], path: Path) -> None:
    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 2.6 * len(timelines)), squeeze=False)
    for ax, (title, (result, at)) in zip(axes[:, 0], timelines.items()):
        events = np.array([(sent - at, (answered - sent) * 1000) for sent, answered, _ in result.events])
        ok = np.array([status == "200" for _, _, status in result.events])
        if len(events):
            ax.scatter(events[ok, 0], events[ok, 1], s=2, label="200")
            ax.scatter(events[~ok, 0], events[~ok, 1], s=6, color="red", label="other")
        ax.axvline(0, color="black", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("latency, ms")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds from the disruption")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
