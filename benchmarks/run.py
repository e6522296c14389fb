"""One benchmark run: build the archive, serve it, replay traffic, measure the in-process ceiling.

For each batch size of the scenario the archive is registered afresh (register-to-ready time and
the workers' peak RSS while loading are recorded), every workload is replayed closed loop at each
concurrency and open loop at each rate, and each level's formed batches are read from our
handler's counters; once the server has stopped (nothing else then runs beside it), the same
artifact is timed in-process at those batch sizes.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import time
from pathlib import Path

import torch
from tqdm import tqdm

from archive_tools.model_config import ServingConfig
from archive_tools.local_server import HandlerCounters, LocalTorchServe
from benchmarks import report
from benchmarks.building import build
from benchmarks.inprocess import CeilingProcess
from benchmarks.load import LoadResult, run_closed_loop, run_open_loop
from benchmarks.worker_cpu import worker_cpu_s
from benchmarks.wrk import run_wrk
from benchmarks.memory import PeakSampler, table_memory_mib, worker_memory
from benchmarks.scenarios import Scenario
from benchmarks.traffic import Traffic
from handlers.modeling.registry import load_spec
from handlers.modeling.spec import ModelSpec

WARMUP_REQUESTS = 20


def run(scenario: Scenario, out_dir: Path, traces: dict[str, Path] | None = None) -> dict:
    """Runs ``scenario`` end to end; writes results.json, plots and summary.txt into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = load_spec(scenario.spec)
    traffic = _traffic(scenario, spec, out_dir, traces or {})

    build = _build_archive(scenario, out_dir / "model_store")
    archive = Path(build["archive"])
    tables = table_memory_mib(spec)

    results: dict = {
        "scenario": scenario.name,
        "spec": str(scenario.spec.relative_to(scenario.spec.parents[2])),
        "machine": _machine(),
        "build": build,
        "tables_mib": tables,
        "configs": [],
    }
    levels = sum(len(w.concurrencies) + len(w.open_rates) for w in scenario.workloads)
    progress = tqdm(total=levels * len(scenario.batch_sizes), desc=scenario.name, unit="level")
    with LocalTorchServe(model_store=archive.parent) as server:
        for batch_size in scenario.batch_sizes:
            config = _register(server, archive, spec.name, batch_size, scenario)
            for workload in scenario.workloads:
                load = traffic[workload.name]
                url = f"{server.inference_url}/predictions/{spec.name}"
                headers = server.auth("inference")
                run_closed_loop(url, headers, load, 4, 60.0, WARMUP_REQUESTS)
                plan = [("closed", c) for c in workload.concurrencies]
                plan += [("open", r) for r in workload.open_rates]
                for mode, level in plan:
                    progress.set_postfix_str(f"batch {batch_size}, {workload.name}, {mode} {level:g}")
                    before = server.handler_counters(spec.name)
                    cpu_before = worker_cpu_s(server.process.pid)
                    if mode == "closed":
                        result = run_wrk(url, headers, load, int(level), scenario.duration_s)
                    else:
                        result = run_open_loop(url, headers, load, level, scenario.duration_s)
                    worker_cpu = worker_cpu_s(server.process.pid) - cpu_before
                    formed = server.handler_counters(spec.name).minus(before)
                    config["runs"].append(_run_record(workload.name, result, formed, worker_cpu))
                    progress.update()
            config["worker_after_runs"] = dataclasses.asdict(worker_memory(server.process.pid))
            if scenario.measure_two_workers and batch_size == scenario.batch_sizes[-1]:
                config["two_workers"] = _two_workers(server, spec.name, traffic[scenario.workloads[0].name])
            server.management("DELETE", f"/models/{spec.name}").raise_for_status()
            results["configs"].append(config)
    progress.set_postfix_str("in-process ceilings")
    _add_ceilings(results["configs"], CeilingProcess(archive, traffic, ServingConfig.intra_op_threads), scenario.ceiling_s)
    progress.close()
    results["targets"] = report.evaluate_targets(scenario, results)
    report.write(results, out_dir)
    return results


def _two_workers(server: LocalTorchServe, name: str, load: Traffic) -> dict:
    """Summed PSS of the model's workers with one worker, then scaled to two, each after the same
    traffic: tables mapped from one file are shared, so two workers cost little more than one."""
    url = f"{server.inference_url}/predictions/{name}"
    run_closed_loop(url, server.auth("inference"), load, 8, 10.0, 2 * len(load.bodies))
    one = worker_memory(server.process.pid)
    response = server.management(
        "PUT", f"/models/{name}", params={"min_worker": 2, "max_worker": 2, "synchronous": "true"}
    )
    response.raise_for_status()
    run_closed_loop(url, server.auth("inference"), load, 8, 10.0, 4 * len(load.bodies))
    two = worker_memory(server.process.pid)
    return {"one": dataclasses.asdict(one), "two": dataclasses.asdict(two)}


def _traffic(
    scenario: Scenario, spec: ModelSpec, out_dir: Path, traces: dict[str, Path]
) -> dict[str, Traffic]:
    traffic = {}
    for seed, workload in enumerate(scenario.workloads):
        if workload.name in traces:
            traffic[workload.name] = Traffic.read_trace(traces[workload.name], spec.dense_features)
        else:
            traffic[workload.name] = workload.traffic.generate(spec, scenario.pool_requests, seed)
        traffic[workload.name].write_trace(out_dir / "traces" / f"{workload.name}.jsonl")
    return traffic


def _build_archive(scenario: Scenario, model_store: Path) -> dict:
    """Builds in a child process, so that its peak memory is the child's own maximum RSS."""
    started = time.perf_counter()
    build(scenario.spec, model_store, "--max-batch-delay", str(scenario.max_batch_delay_ms), *scenario.build_args)
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    name = load_spec(scenario.spec).name
    unzipped = "no-archive" in scenario.build_args
    archive = model_store / (name if unzipped else f"{name}.mar")
    size = sum(f.stat().st_size for f in archive.rglob("*")) if unzipped else archive.stat().st_size
    return {
        "archive": str(archive),
        "seconds": seconds,
        "peak_rss_mib": peak_kib / 1024,
        "archive_mib": size / 2**20,
    }


def _register(server: LocalTorchServe, archive: Path, name: str, batch_size: int, scenario: Scenario) -> dict:
    delay_ms = scenario.max_batch_delay_ms
    admission = {} if scenario.max_queue_wait_ms is None else {"max_queue_wait_ms": scenario.max_queue_wait_ms}
    with PeakSampler(server.process.pid) as sampler:
        started = time.perf_counter()
        response = server.register(
            archive.name, batch_size=batch_size, max_batch_delay=delay_ms, initial_workers=1, **admission
        )
        register_s = time.perf_counter() - started
    response.raise_for_status()
    described = server.management("GET", f"/models/{name}").json()[0]
    if described["batchSize"] != batch_size:
        raise RuntimeError(f"registered with batch_size {batch_size}, TorchServe uses {described['batchSize']}")
    return {
        "batch_size": batch_size,
        "max_batch_delay_ms": delay_ms,
        "register_s": register_s,
        "load_peak_rss_mib": sampler.peak_rss_mib,
        "worker_loaded": dataclasses.asdict(worker_memory(server.process.pid)),
        "runs": [],
    }


def _add_ceilings(configs: list[dict], ceiling: CeilingProcess, seconds: float) -> None:
    """Each run's in-process ceiling at the batch size the server formed for it, and the share of
    it that was served; each workload and batch size timed once."""
    ceilings: dict[tuple[str, int], float] = {}
    with ceiling:
        for run in (run for config in configs for run in config["runs"]):
            key = (run["workload"], max(1, round(run["formed"]["mean_requests_per_batch"])))
            if key not in ceilings:
                ceilings[key] = ceiling.items_per_s(*key, seconds)
            run["ceiling_items_per_s"] = ceilings[key]
            run["efficiency"] = run["items_per_s"] / ceilings[key]


def _run_record(workload: str, result: LoadResult, formed: HandlerCounters, worker_cpu_s: float) -> dict:
    return {
        "workload": workload,
        **result.to_dict(),
        "worker_cpu_us_per_item": worker_cpu_s / max(1, result.items) * 1e6,
        "formed": {
            "requests": formed.requests,
            "items": formed.forward_items,
            "batches": {str(k): v for k, v in sorted(formed.batches.items())},
            "mean_requests_per_batch": formed.mean_requests_per_batch,
            "mean_items_per_forward": formed.mean_items_per_forward,
        },
    }


def _machine() -> dict:
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
