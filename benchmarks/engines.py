"""The engines scenario: the same archives, requests and points on TorchServe (the default engine)
and on the project's asgi engine (``torchrec-serve serve --engine asgi``), in one run.

    make bench SCENARIO=engines         # the Criteo-shaped model, compiled (AOTInductor); about 6 min
    make bench SCENARIO=engines-smoke   # the tiny model, eager; the test suite runs it

Both engines serve archives built with the project's production settings (``ServingConfig``:
batch_size 32, max_batch_delay 5 ms; for the concurrency-1 point the same model built with
batch_size 1, batching off), each as it is deployed on this machine: TorchServe's Java frontend
(its HTTP on threads of its own) with one worker per model, the asgi engine with its default
``--workers``, one process per core (each parses its own connections' HTTP and batches them).
``asgi_one_process_one_item_c32_items_per_s`` beside them: the asgi engine with ``--workers 1``.
Closed loops are ``wrk``, one item per request unless said:

* ``*_one_item_c1_p50_ms``: concurrency 1, batching off;
* ``*_one_item_c32_items_per_s`` and ``*_p99_ms_c32``: concurrency 32, batch 32 / 5 ms;
* ``*_100cand_items_per_s``: 100-candidate requests at concurrency 32, batch 32 / 5 ms;
* ``*_floor_c32_items_per_s``: each engine's no-op floor, one item at concurrency 32, batch 32 /
  5 ms: TorchServe's with ``benchmarks/noop_handler.py``, the asgi engine's with
  ``benchmarks/asgi_floor.py`` (its routes, keys and batcher as they are, each batch answered
  without scoring).

``max_score_diff_engines``: the same requests (one-item and 100-candidate) sent to both engines'
batch-32 model one at a time, the largest absolute score difference. ``asgi_two_process_pss_ratio``:
the summed PSS (``/proc/PID/smaps_rollup``) of the asgi engine's two processes with ``--workers 2``
over its one process's with ``--workers 1``, serving the Criteo 1TB row counts (6.0 GiB of tables,
as TorchServe's two workers are measured in the criteo-1tb scenario), measured back to back after
the same traffic once the other servers are stopped; ``asgi_two_process_pss_ratio_scored_model``:
the same on the points' model, whose 62 MiB of tables are smaller than a process's own memory. With ``--workers 1`` uvicorn serves in the CLI's own process, which has
imported the whole CLI (TorchRec and the build pipeline among it); with two, each worker process
imports the engine alone, so the one process holds more than a worker and the ratio understates
what a second process costs. Beside each process's PSS, its mappings of the tables' working copy
(``tables``: resident, proportional and private MiB; mapped shared by every process, none of it
private). ``ts_two_worker_pss_ratio`` beside it (full scenario): TorchServe's batch-32
model, two workers over one. ``cpu``: for every point, the server's processes (cores: the process
group's CPU time from /proc over the point's wall time) and ``wrk``'s.

The servers are started one after another, then each is measured in turn while the others
idle, and stopped once its points are done.

Writes ``engines.json``, ``summary.txt`` (each target beside its figure) and ``engines.png``
(``benchmarks/engines_report.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson
import requests
from tqdm import tqdm

from archive_tools.local_asgi import LocalAsgiServer
from archive_tools.local_server import LocalTorchServe
from archive_tools.model_config import ServingConfig
from benchmarks import engines_report
from benchmarks import asgi_floor
from benchmarks.building import NOOP, build, build_noop
from benchmarks.load import run_closed_loop
from benchmarks.memory import mapped_mib, pss_mib
from benchmarks.scenarios import CRITEO_CANDIDATE_FEATURES, MODELS
from benchmarks.traffic import Traffic, TrafficModel
from benchmarks.worker_cpu import group_cpu_s
from benchmarks.wrk import run_wrk
from handlers.modeling.registry import load_spec
from handlers.runtime.freshness.shared_tables import ROOTS

BATCH_SIZE = ServingConfig.batch_size
MAX_BATCH_DELAY_MS = ServingConfig.max_batch_delay_ms
CONCURRENCY = 32
SCORED_ONE_ITEM, SCORED_CANDIDATES = 32, 8  # requests of each kind sent to both engines to compare scores


@dataclasses.dataclass(frozen=True)
class EnginesScenario:
    name: str
    spec: Path
    build_args: tuple[str, ...]
    candidate_features: tuple[str, ...]  # the features that vary per candidate in a 100-candidate request
    seconds: float = 10.0  # per point
    warmup_s: float = 2.0  # wrk at concurrency 4 before each point; 0: 20 requests of the Python client
    pool_requests: int = 512  # distinct one-item requests (half as many 100-candidate ones), cycled
    ts_two_workers: bool = True  # TorchServe's two-worker PSS ratio too, beside the asgi engine's
    # the asgi engine's PSS, one process and two, on a model of large tables (None: on ``spec``'s)
    pss_spec: Path | None = None
    pss_build_args: tuple[str, ...] = ()


ENGINES_SCENARIOS = {
    "engines": EnginesScenario(
        "engines", MODELS / "criteo.yaml", ("--artifact", "aoti"), CRITEO_CANDIDATE_FEATURES,
        pss_spec=MODELS / "criteo_1tb.yaml",  # 6.0 GiB of tables, as the speed-1tb scenario builds them
        pss_build_args=("--init", "quantized", "--archive-format", "no-archive", "--artifact", "aoti"),
    ),
    "engines-smoke": EnginesScenario(
        "engines-smoke", MODELS / "tiny.yaml", (), ("item_id",), seconds=1.0, warmup_s=0.0, pool_requests=64,
        ts_two_workers=False,
    ),
}


@dataclasses.dataclass(frozen=True)
class _Side:
    """One engine's server as the points reach it: its base URL, its inference key's header, and
    its process group (every process of the server)."""

    url: str
    auth: dict[str, str]
    group: int


class _Points:
    """Closed-loop points with ``wrk``, each kept with the server's and the client's CPU."""

    def __init__(self, scenario: EnginesScenario, progress: tqdm) -> None:
        self.scenario = scenario
        self.progress = progress
        self.points: dict[str, dict] = {}

    def serve(self, key: str, side: _Side, model: str, traffic: Traffic, concurrency: int) -> None:
        self.progress.set_postfix_str(key)
        url = f"{side.url}/predictions/{model}"
        self.warm(side, model, traffic)
        cpu_before, started = group_cpu_s(side.group), time.perf_counter()
        result = run_wrk(url, side.auth, traffic, concurrency, self.scenario.seconds)
        wall_s = time.perf_counter() - started
        self.points[key] = {
            "items_per_s": result.items_per_s,
            "requests": result.requests,
            "statuses": result.statuses,
            "latency_ms": result.latency_ms,
            "cpu": {
                "server_cores": (group_cpu_s(side.group) - cpu_before) / wall_s,
                "client": result.client,
                "client_cores": result.client_cpu_cores,
                "client_saturated": result.client_saturated,
            },
        }
        self.progress.update()

    def warm(self, side: _Side, model: str, traffic: Traffic, concurrency: int = 4) -> None:
        url = f"{side.url}/predictions/{model}"
        if self.scenario.warmup_s > 0:
            run_wrk(url, side.auth, traffic, concurrency, self.scenario.warmup_s)
        else:
            run_closed_loop(url, side.auth, traffic, concurrency, 60.0, 20)


def run_engines(scenario: EnginesScenario, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = load_spec(scenario.spec)
    traffic = {
        "one": TrafficModel(items_per_request=1).generate(spec, scenario.pool_requests, seed=1),
        "cand": TrafficModel(items_per_request=100, candidate_features=scenario.candidate_features).generate(
            spec, max(SCORED_CANDIDATES, scenario.pool_requests // 2), seed=2),
    }
    scored = traffic["one"].bodies[:SCORED_ONE_ITEM] + traffic["cand"].bodies[:SCORED_CANDIDATES]
    progress = tqdm(total=14 + scenario.ts_two_workers, desc=scenario.name, unit="step")
    results: dict = {"scenario": scenario.name, "spec": spec.name, "cpus": len(os.sched_getaffinity(0)),
                     "load_average_at_start": os.getloadavg()}
    progress.set_postfix_str("building")
    store = out_dir / "model_store"
    batched, unbatched = _build(scenario, spec.name, store)
    progress.update()
    served = [f"{batched}.mar", f"{unbatched}.mar"]
    torchserve = LocalTorchServe(model_store=store)
    processes = os.cpu_count() or 1  # the asgi engine's default --workers: one process per core
    floor = LocalAsgiServer(store, [f"{batched}.mar"], processes, entry=(asgi_floor.MODULE,))
    one, two = LocalAsgiServer(store, served, 1), LocalAsgiServer(store, served, 2)
    default = two if processes == 2 else LocalAsgiServer(store, served, processes)
    points = _Points(scenario, progress)
    answers = {}
    with contextlib.ExitStack() as running:
        asgi_servers = list(dict.fromkeys((floor, one, two, default)))  # default may be two
        for server in (torchserve, *asgi_servers):
            running.callback(server.stop)  # stopping one never started, or stopped, does nothing
        progress.set_postfix_str("starting both engines' servers")
        _start_torchserve(torchserve, batched, unbatched)
        for server in asgi_servers:  # one at a time: three compiled models loading at once outran 180 s
            server.start()
        progress.update()
        progress.set_postfix_str("asgi: PSS, one process, then two")
        results["asgi_pss_mib"] = {
            "one_process": _pss_after_traffic(points, _asgi_side(one), batched, traffic["one"], one.processes(batched, 1)),
            "two_processes": _pss_after_traffic(points, _asgi_side(two), batched, traffic["one"], two.processes(batched, 2)),
        }
        if default is not two:
            two.stop()
        progress.update()
        ts = _Side(torchserve.inference_url, torchserve.auth("inference"), torchserve.process.pid)
        points.serve("ts_floor_c32", ts, NOOP, traffic["one"], CONCURRENCY)
        _model_points(points, "ts", ts, batched, unbatched, traffic)
        answers["ts"] = _scores(ts, batched, scored)
        if scenario.ts_two_workers:
            progress.set_postfix_str("TorchServe: PSS, one worker, then two")
            results["ts_pss_mib"] = _ts_two_workers(torchserve, points, ts, batched, traffic["one"])
            progress.update()
        torchserve.stop()
        points.serve("asgi_floor_c32", _asgi_side(floor), batched, traffic["one"], CONCURRENCY)
        floor.stop()
        points.serve("asgi_one_process_one_item_c32", _asgi_side(one), batched, traffic["one"], CONCURRENCY)
        one.stop()
        asgi = _asgi_side(default)
        _model_points(points, "asgi", asgi, batched, unbatched, traffic)
        answers["asgi"] = _scores(asgi, batched, scored)
        results["asgi_processes"] = processes
    if scenario.pss_spec is not None:
        progress.set_postfix_str(f"asgi: PSS on {scenario.pss_spec.stem}, one process, then two")
        results["asgi_large_tables_pss_mib"] = _large_tables_pss(scenario, store, points)
    progress.update()
    progress.close()
    results["load_average_at_end"] = os.getloadavg()
    results.update(_figures(points.points, answers, results))
    results["targets"] = engines_report.targets(results)
    (out_dir / "engines.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    (out_dir / "summary.txt").write_text(engines_report.summary(results))
    engines_report.plot(results, out_dir / "engines.png")
    print(engines_report.summary(results))
    return results


def _build(scenario: EnginesScenario, name: str, store: Path) -> tuple[str, str]:
    """The model with the production settings (``NAME.mar``), the same model with batching off
    (``NAME-unbatched.mar``), both built at once, and the no-op handler's archive."""
    unbatched = f"{name}-unbatched"
    with ThreadPoolExecutor(max_workers=2) as pool:
        builds = [
            pool.submit(build, scenario.spec, store, *scenario.build_args, quiet=True),
            pool.submit(build, scenario.spec, store, *scenario.build_args, "--batch-size", "1", "--name", unbatched,
                        quiet=True),
        ]
        build_noop(store)
        for done in builds:
            done.result()
    return name, unbatched


def _start_torchserve(server: LocalTorchServe, batched: str, unbatched: str) -> None:
    """TorchServe with the no-op archive and both models registered, one worker each, each with
    its archive's batching."""
    server.start()
    for archive, batch_size in ((NOOP, BATCH_SIZE), (unbatched, 1), (batched, BATCH_SIZE)):
        server.register(f"{archive}.mar", batch_size=batch_size, max_batch_delay=MAX_BATCH_DELAY_MS).raise_for_status()


def _asgi_side(server: LocalAsgiServer) -> _Side:
    return _Side(server.url, server.auth, server.process.pid)


def _model_points(points: _Points, engine: str, side: _Side, batched: str, unbatched: str, traffic: dict) -> None:
    points.serve(f"{engine}_one_item_c1", side, unbatched, traffic["one"], 1)
    points.serve(f"{engine}_one_item_c32", side, batched, traffic["one"], CONCURRENCY)
    points.serve(f"{engine}_100cand_c32", side, batched, traffic["cand"], CONCURRENCY)


def _scores(side: _Side, model: str, bodies: list[bytes]) -> list[float]:
    """Every score of ``bodies``, each request sent alone, in order."""
    scores: list[float] = []
    with requests.Session() as session:
        for body in bodies:
            answer = session.post(f"{side.url}/predictions/{model}", data=body, timeout=60,
                                  headers={**side.auth, "Content-Type": "application/json"})
            answer.raise_for_status()
            scores += answer.json()["scores"]
    return scores


def _pss_after_traffic(points: _Points, side: _Side, model: str, traffic: Traffic, pids: list[int]) -> dict:
    """The processes' PSS (MiB), each and summed, after the warm-up traffic at concurrency 32
    (spread over the processes' connections); and each one's mappings of the tables' working
    copies (``tables``: rss, pss, private MiB; shared between processes, none of it is private)."""
    points.warm(side, model, traffic, CONCURRENCY)
    each = [pss_mib(pid) for pid in pids]
    return {"processes": len(pids), "each": each, "total": sum(each), "tables": [mapped_mib(pid, ROOTS) for pid in pids]}


def _large_tables_pss(scenario: EnginesScenario, store: Path, points: _Points) -> dict:
    """The asgi engine's PSS with one process, then two, serving ``pss_spec`` (built as
    ``pss_build_args`` say), after the same one-item traffic; the other servers stopped."""
    spec = load_spec(scenario.pss_spec)
    build(scenario.pss_spec, store, *scenario.pss_build_args, quiet=True)
    traffic = TrafficModel(items_per_request=1).generate(spec, scenario.pool_requests, seed=1)
    measured = {}
    for key, workers in (("one_process", 1), ("two_processes", 2)):
        with LocalAsgiServer(store, [spec.name], workers) as server:
            measured[key] = _pss_after_traffic(points, _asgi_side(server), spec.name, traffic,
                                               server.processes(spec.name, workers))
    return measured


def _ts_two_workers(server: LocalTorchServe, points: _Points, side: _Side, model: str, traffic: Traffic) -> dict:
    """The model's workers' PSS after the same traffic, with one worker, then scaled to two."""
    one = _pss_after_traffic(points, side, model, traffic, _ts_workers(server, model))
    response = server.management("PUT", f"/models/{model}", params={"min_worker": 2, "max_worker": 2, "synchronous": "true"})
    response.raise_for_status()
    return {"one_worker": one, "two_workers": _pss_after_traffic(points, side, model, traffic, _ts_workers(server, model))}


def _ts_workers(server: LocalTorchServe, model: str) -> list[int]:
    described = server.management("GET", f"/models/{model}").json()[0]
    return [worker["pid"] for worker in described["workers"] if worker["status"] == "READY"]


def _figures(points: dict[str, dict], answers: dict[str, list[float]], results: dict) -> dict:
    """The scenario's flat figures, each engine's, from its points."""
    figures: dict = {}
    for engine in ("ts", "asgi"):
        figures[f"{engine}_one_item_c32_items_per_s"] = points[f"{engine}_one_item_c32"]["items_per_s"]
        figures[f"{engine}_floor_c32_items_per_s"] = points[f"{engine}_floor_c32"]["items_per_s"]
        figures[f"{engine}_one_item_c1_p50_ms"] = points[f"{engine}_one_item_c1"]["latency_ms"]["p50"]
        figures[f"{engine}_100cand_items_per_s"] = points[f"{engine}_100cand_c32"]["items_per_s"]
        figures[f"{engine}_p99_ms_c32"] = points[f"{engine}_one_item_c32"]["latency_ms"]["p99"]
    figures["asgi_one_process_one_item_c32_items_per_s"] = points["asgi_one_process_one_item_c32"]["items_per_s"]
    ts, asgi = np.asarray(answers["ts"]), np.asarray(answers["asgi"])
    if ts.shape != asgi.shape:
        raise RuntimeError(f"the engines answered {ts.shape} and {asgi.shape} scores to the same requests")
    figures["max_score_diff_engines"] = float(np.abs(ts - asgi).max())
    figures["scores_compared"] = int(ts.size)
    pss = results.get("asgi_large_tables_pss_mib", results["asgi_pss_mib"])
    figures["asgi_two_process_pss_ratio"] = pss["two_processes"]["total"] / pss["one_process"]["total"]
    small = results["asgi_pss_mib"]
    figures["asgi_two_process_pss_ratio_scored_model"] = small["two_processes"]["total"] / small["one_process"]["total"]
    if "ts_pss_mib" in results:
        ts_pss = results["ts_pss_mib"]
        figures["ts_two_worker_pss_ratio"] = ts_pss["two_workers"]["total"] / ts_pss["one_worker"]["total"]
    figures["cpu"] = {key: point["cpu"] for key, point in points.items()}
    figures["points"] = {key: {k: v for k, v in point.items() if k != "cpu"} for key, point in points.items()}
    return figures
