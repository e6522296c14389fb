"""The reliability suite's disruptions of a serving TorchServe, each under load: a worker killed or
hung, scale-downs, a version swap, twice the capacity offered; and the calls they share.

Each returns the load's result (its every request's times and status) and the figures it measured.
The loads are the Python client's (``benchmarks.load``), whose requests in flight are bounded by
nothing but ``max_in_flight``: wrk's open loop holds one request a connection, and when a
disruption slows the answers past its connections it sends late, as a closed loop would, so that
fewer requests meet the disruption and fewer fail (a version swap at 1,500 requests/s on this
machine, busy with other work: 86 and 72 503s with wrk, 40,000-50,000 of its sends late, against
8,545 and 11,593 with the Python client).
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Any, Callable

import requests

from archive_tools.local_server import LocalTorchServe
from benchmarks.load import BackgroundLoad, LoadResult, run_closed_loop, run_open_loop
from benchmarks.traffic import Traffic


def ok(response: requests.Response) -> requests.Response:
    """``response``, or an error naming the call when it is not a 200."""
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.method} {response.url}: {response.status_code} {response.text}")
    return response


def failed(result: LoadResult) -> int:
    return sum(n for status, n in result.statuses.items() if status != "200")


def kill_worker(
    server: LocalTorchServe, name: str, url: str, auth: dict, traffic: Traffic, rate: float, seconds: float
) -> tuple[LoadResult, float, dict]:
    result, killed_at, _, recovered_at = _signalled(server, name, url, auth, traffic, rate, seconds, signal.SIGKILL)
    failures = [answered for sent, answered, status in result.events if status != "200" and answered > killed_at]
    shown_at = min(failures, default=killed_at)
    in_flight = sum(1 for sent, answered, _ in result.events if sent <= shown_at and answered >= killed_at)
    return result, killed_at, {
        "kill_worker_failed_requests": failed(result),
        "kill_worker_statuses": result.statuses,
        "kill_worker_inflight": in_flight,
        "kill_worker_recovery_s": recovered_at - killed_at,
    }


def hang_worker(
    server: LocalTorchServe, name: str, url: str, auth: dict, traffic: Traffic, rate: float, seconds: float
) -> tuple[LoadResult, float, dict]:
    result, stopped_at, detected_at, recovered_at = _signalled(
        server, name, url, auth, traffic, rate, seconds, signal.SIGSTOP,
        detected=lambda: "stopped answering" in _ping(server),
    )
    return result, stopped_at, {
        "hung_worker_detect_s": detected_at - stopped_at,  # type: ignore[operator]  # detected is given
        "hung_worker_recovery_s": recovered_at - stopped_at,
        "hung_worker_failed_requests": failed(result),
        "hung_worker_statuses": result.statuses,
    }


def _signalled(
    server: LocalTorchServe, name: str, url: str, auth: dict, traffic: Traffic, rate: float, seconds: float,
    sig: int, detected: Callable[[], bool] | None = None,
) -> tuple[LoadResult, float, float | None, float]:
    """Under load, the newest of the model's two workers sent ``sig`` halfway through ``seconds``:
    the load's result, when it was sent, when ``detected`` first held, and when two workers (not
    that one) were ready again."""
    with BackgroundLoad(url, auth, traffic, rate) as load:
        time.sleep(seconds / 2)
        victim = _ready_pids(server, name)[-1]
        sent_at = time.perf_counter()
        os.kill(victim, sig)
        detected_at = _wait(detected, 60, every_s=0.05) if detected is not None else None
        recovered_at = _wait(lambda: _recovered(server, name, victim, 2), 120)
        time.sleep(seconds / 2)
    return load.result, sent_at, detected_at, recovered_at


def scale_down_trials(
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


def version_swap(
    server: LocalTorchServe, name: str, url: str, auth: dict, traffic: Traffic, rate: float, **register: Any
) -> tuple[LoadResult, float]:
    """Version 2.0 registered (with ``register``'s options), made the default, 1.0 unregistered,
    under load."""
    with BackgroundLoad(url, auth, traffic, rate) as load:
        time.sleep(1.0)
        started = time.perf_counter()
        ok(server.register(f"{name}-v2.mar", initial_workers=1, **register))
        ok(server.management("PUT", f"/models/{name}/2.0/set-default"))
        ok(server.management("DELETE", f"/models/{name}/1.0"))
        time.sleep(1.0)
    return load.result, started


def overload(server: LocalTorchServe, name: str, traffic: Traffic, phase_s: float, overload_s: float) -> dict:
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
