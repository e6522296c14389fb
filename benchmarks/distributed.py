"""Benchmark scenario ``distributed`` (and ``distributed-smoke``): one model served on one host,
then as an embedding-dense layout on loopback (``torchrec-serve launch``): two shards, the tables
dealt so that each holds about half their bytes, shard ``a`` on two replicas, and one dense host.
Both are built from the same spec and seed (the same tables, byte for byte) and measured under the
same load, one after the other. Written to ``distributed.json``:

* ``single_host_100cand_items_per_s``, ``di_100cand_items_per_s``: 100-candidate requests, closed
  loop at concurrency 8 (``wrk``);
* ``single_host_p50_ms``, ``di_p50_ms``, ``di_extra_p50_ms``: the same requests one at a time;
* ``clients``: each of those points' client, its CPU in cores and whether it was saturated;
* ``max_score_diff``: the layout's scores against the single host's, on the same requests;
* ``shard_answer_kib_per_request``: the pooled embeddings the shards answer for one request (each
  distinct bag once), against ``shard_answer_kib_per_request_all_bags`` (every item's every bag);
* ``shard_lookups_p50_ms``: a dense host's calls to both shards for one 100-candidate request,
  made from this process one at a time, and ``shard_handler_ms_per_call``: the part of each call
  spent in shard ``b``'s handler (its stage times); the rest is the trip through TorchServe;
* ``single_host_rss_mib``, ``shard_rss_mib`` (the largest shard host), ``dense_rss_mib``,
  ``shard_rss_ratio``: the model workers' RSS after the runs (tables pinned in memory: all counted);
* ``failover_failed_requests``: one of shard ``a``'s replicas stopped, then started again, under
  an open loop at half the layout's one-item closed-loop rate;
* ``shard_down_answer_ms``: shard ``b`` (one replica) stopped: how long a request takes to be
  answered with its 503 (median of 5).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import orjson  # noqa: E402
import requests  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tqdm import tqdm  # noqa: E402

from archive_tools.launcher import HostGroup, LayoutFile, LocalLayout  # noqa: E402
from archive_tools.local_server import LocalTorchServe  # noqa: E402
from benchmarks.building import build  # noqa: E402
from benchmarks.load import BackgroundLoad, run_closed_loop  # noqa: E402
from benchmarks.wrk import run_wrk  # noqa: E402
from benchmarks.memory import worker_memory  # noqa: E402
from benchmarks.scenarios import CRITEO_CANDIDATE_FEATURES, MODELS  # noqa: E402
from benchmarks.traffic import Traffic, TrafficModel  # noqa: E402
from handlers.modeling.factory import DLRMFactory  # noqa: E402
from handlers.modeling.registry import input_schema, load_spec  # noqa: E402
from handlers.modeling.spec import ModelSpec  # noqa: E402
from handlers.runtime.archive import Archive  # noqa: E402
from handlers.runtime.batching import coalesce  # noqa: E402
from handlers.runtime.remote.lookups import ShardCaller, ShardedLookups, distinct_ids  # noqa: E402
from handlers.runtime.remote.plan import read_placement  # noqa: E402
from handlers.runtime.wire.decoder import RequestDecoder  # noqa: E402


@dataclasses.dataclass(frozen=True)
class DistributedScenario:
    name: str
    spec: Path
    build_args: tuple[str, ...]
    candidate_features: tuple[str, ...]
    duration_s: float  # per measurement
    failover_s: float  # load before, between and after the replica's stop and start


DISTRIBUTED_SCENARIOS = {
    "distributed": DistributedScenario(
        "distributed", MODELS / "criteo_1tb.yaml",
        ("--init", "quantized", "--archive-format", "no-archive"),
        CRITEO_CANDIDATE_FEATURES, duration_s=20.0, failover_s=5.0,
    ),
    "distributed-smoke": DistributedScenario(
        "distributed-smoke", MODELS / "tiny.yaml", (), ("item_id",), duration_s=2.0, failover_s=1.5,
    ),
}

TARGETS = (  # (key, op, bound)
    ("max_score_diff", "<=", 1e-6),
    ("di_extra_p50_ms", "<=", 1.0),
    ("failover_failed_requests", "<=", 0),
    ("shard_rss_ratio", "<=", 0.6),
)
SHARDS = ("a", "b")


def run_distributed(scenario: DistributedScenario, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    store = out_dir / "model_store"
    shutil.rmtree(store, ignore_errors=True)
    spec = _placed(load_spec(scenario.spec))
    spec_path = out_dir / "spec.yaml"
    spec.to_yaml(spec_path)
    name = spec.name
    _build(spec_path, store, ("--artifact", "aoti", "--name", f"{name}-single", *scenario.build_args))
    _build(spec_path, store, ("--artifact", "distributed", "--dense", "aoti", *scenario.build_args))
    candidates = TrafficModel(items_per_request=100, candidate_features=scenario.candidate_features).generate(spec, 64, seed=2)
    one_item = TrafficModel(items_per_request=1).generate(spec, 512, seed=1)
    figures: dict = {"scenario": scenario.name, "shard_tables": {s: [t.name for t in ts] for s, ts in spec.shards.items()},
                     "shard_table_mib": _shard_mib(spec), **answer_kib(spec, candidates)}
    progress = tqdm(total=4, desc=scenario.name, unit="phase")

    with LocalTorchServe(model_store=store) as server:
        _ok(server.register(HostGroup(f"{name}-single").in_store(store), initial_workers=1))
        single = _measure(server, f"{name}-single", candidates, scenario.duration_s)
        figures["single_host_rss_mib"] = worker_memory(server.process.pid).rss_mib
    progress.update()

    layout = LayoutFile(
        model_store=store.resolve(),
        dense=HostGroup(f"{name}-dense"),
        shards={"a": HostGroup(f"{name}-a", hosts=2), "b": HostGroup(f"{name}-b")},
    )
    with LocalLayout(layout) as running:
        dense = running.dense[0]
        distributed = _measure(dense, f"{name}-dense", candidates, scenario.duration_s)
        figures.update(shard_hop(running, spec, candidates, scenario.duration_s))
        figures["shard_rss_mib_by_host"] = {
            f"{shard}-{i}": worker_memory(host.process.pid).rss_mib
            for shard, hosts in running.shards.items() for i, host in enumerate(hosts)
        }
        figures["dense_rss_mib"] = worker_memory(dense.process.pid).rss_mib
        progress.update()
        figures.update(_failover(running, f"{name}-dense", one_item, scenario.failover_s))
        progress.update()
        figures["shard_down_answer_ms"], figures["shard_down_statuses"] = _shard_down(running, f"{name}-dense", one_item)
        progress.update()
    progress.close()

    figures.update(_compared(single, distributed))
    figures["shard_rss_mib"] = max(figures["shard_rss_mib_by_host"].values())
    figures["shard_rss_ratio"] = figures["shard_rss_mib"] / figures["single_host_rss_mib"]
    (out_dir / "distributed.json").write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    (out_dir / "summary.txt").write_text(_summary(figures))
    _plot(figures, out_dir / "distributed.png")
    shutil.rmtree(store, ignore_errors=True)  # GBs of tables; rebuilt by the next run
    print(_summary(figures))
    return figures


def _compared(single: dict, distributed: dict) -> dict:
    """The one host's and the layout's measurements side by side, and how far their scores lie."""
    return {
        "single_host_100cand_items_per_s": single["items_per_s"],
        "di_100cand_items_per_s": distributed["items_per_s"],
        "single_host_p50_ms": single["p50_ms"],
        "di_p50_ms": distributed["p50_ms"],
        "di_extra_p50_ms": distributed["p50_ms"] - single["p50_ms"],
        "single_host_p99_ms": single["p99_ms"],
        "di_p99_ms": distributed["p99_ms"],
        "single_host_statuses": single["statuses"],
        "di_statuses": distributed["statuses"],
        "max_score_diff": float(np.max(np.abs(single["scores"] - distributed["scores"]))),
        "clients": {**{f"single_host_{k}": v for k, v in single["clients"].items()},
                    **{f"di_{k}": v for k, v in distributed["clients"].items()}},
    }


def _placed(spec: ModelSpec) -> ModelSpec:
    """The spec with its tables dealt to two shards, largest first to the lighter one: each holds
    about half the bytes."""
    sizes = DLRMFactory(spec).table_bytes()
    held = dict.fromkeys(SHARDS, 0)
    shard_of = {}
    for table in sorted(spec.tables, key=lambda t: -sizes[t.name]):
        shard = min(SHARDS, key=lambda s: held[s])
        shard_of[table.name] = shard
        held[shard] += sizes[table.name]
    return spec.replace(tables=[t.model_copy(update={"shard": shard_of[t.name]}) for t in spec.tables])


def _shard_mib(spec: ModelSpec) -> dict[str, float]:
    sizes = DLRMFactory(spec).table_bytes()
    return {s: sum(sizes[t.name] for t in tables) / 2**20 for s, tables in spec.shards.items()}


def answer_kib(spec: ModelSpec, traffic: Traffic) -> dict[str, float]:
    """FP32 embeddings the shards answer per request, each distinct bag once (what a dense host
    asks for) and every bag of every item, averaged over ``traffic``."""
    schema = input_schema(spec)
    decoder = RequestDecoder(schema)
    dims = torch.tensor(spec.feature_dims, dtype=torch.float64)
    sent, every = [], []
    for body in traffic.bodies:
        ids = coalesce([decoder.decode(body).inputs], schema.tags)[schema.jagged.name]
        sent.append(float((distinct_ids(ids).bags * dims).sum()) * 4 / 1024)
        every.append(ids.lengths.shape[1] * float(dims.sum()) * 4 / 1024)
    return {"shard_answer_kib_per_request": float(np.mean(sent)), "shard_answer_kib_per_request_all_bags": float(np.mean(every))}


def shard_hop(layout: LocalLayout, spec: ModelSpec, traffic: Traffic, duration_s: float) -> dict:
    """The dense host's sparse part run from this process (the dense archive's plan, the layout's
    shards), one request at a time, and shard ``b``'s handler time per call over the same calls."""
    store = layout.layout.model_store
    with Archive.open(store / layout.layout.dense.in_store(store)) as archive:
        options = archive.options
    assert options.remote is not None
    plan = options.remote.placed(read_placement(layout.placement_file))
    callers = [ShardCaller(route, plan.deadline) for route in plan.shards]
    schema = input_schema(spec)
    decoder = RequestDecoder(schema)
    batches = [coalesce([decoder.decode(body).inputs], schema.tags) for body in traffic.bodies]
    try:
        for caller in callers:
            caller.connect(timeout_s=10)
        lookups = ShardedLookups(callers, schema.feature_names, schema.jagged.name, schema.weighted_ids, plan.stacked)
        (host_b,) = layout.shards["b"]
        model_b = layout.layout.shards["b"].model
        before = _stage_ms(host_b, model_b)
        times = []
        ends = time.perf_counter() + duration_s
        while time.perf_counter() < ends:
            started = time.perf_counter()
            lookups(batches[len(times) % len(batches)])
            times.append((time.perf_counter() - started) * 1000)
        handler_ms = (_stage_ms(host_b, model_b) - before) / len(times)
    finally:
        for caller in callers:
            caller.close()
    return {"shard_lookups_p50_ms": float(np.median(times)), "shard_handler_ms_per_call": handler_ms}


def _stage_ms(server: LocalTorchServe, model: str) -> float:
    """The model's handler time so far (``HandlerStageMilliseconds``, all stages)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(server.scrape(model))
        if family.name == "HandlerStageMilliseconds"
        for sample in family.samples
        if sample.name.endswith("_total") or sample.name == family.name
    )


def _build(spec_path: Path, store: Path, args: tuple[str, ...]) -> None:
    build(spec_path, store, "--seed", "0", *args)


def _measure(server: LocalTorchServe, model: str, traffic: Traffic, duration_s: float) -> dict:
    """Throughput at concurrency 8 and latency one at a time, of 100-candidate requests, and the
    scores of the first 16 requests."""
    url = f"{server.inference_url}/predictions/{model}"
    auth = server.auth("inference")
    run_wrk(url, auth, traffic, 8, min(duration_s, 5.0))  # warm-up (and shard timings)
    loaded = run_wrk(url, auth, traffic, 8, duration_s)
    solo = run_wrk(url, auth, traffic, 1, duration_s)
    scores = []
    for body in traffic.bodies[:16]:
        response = _ok(requests.post(url, data=body, headers={**auth, "Content-Type": "application/json"}, timeout=60))
        scores.append(response.json()["scores"])
    return {
        "items_per_s": loaded.items_per_s,
        "p50_ms": solo.latency_ms["p50"],
        "p99_ms": solo.latency_ms["p99"],
        "statuses": {k: loaded.statuses.get(k, 0) + solo.statuses.get(k, 0) for k in {*loaded.statuses, *solo.statuses}},
        "scores": np.asarray(scores, dtype=np.float64),
        "clients": {"c8": loaded.client_summary(), "c1": solo.client_summary()},
    }


def _failover(layout: LocalLayout, model: str, traffic: Traffic, phase_s: float) -> dict:
    dense = layout.dense[0]
    url = f"{dense.inference_url}/predictions/{model}"
    auth = dense.auth("inference")
    rate = 0.5 * run_closed_loop(url, auth, traffic, 8, phase_s, 10**6).requests_per_s
    replica = layout.shards["a"][0]
    with BackgroundLoad(url, auth, traffic, rate) as load:
        time.sleep(phase_s)
        stopped = time.perf_counter()
        replica.stop()
        time.sleep(phase_s)
        layout.revive("a", 0)
        back = time.perf_counter()
        time.sleep(phase_s)
    result = load.result
    calls: dict[str, float] = {}
    for family in text_string_to_metric_families(dense.scrape(model)):
        if family.name == "ShardCalls":
            for sample in family.samples:
                key = f"{sample.labels['Shard']} {sample.labels['Outcome']}"
                calls[key] = calls.get(key, 0) + sample.value
    return {
        "failover_shard_calls": calls,  # since the layout started: by shard and outcome
        "failover_rate_rps": rate,
        "failover_requests": result.requests,
        "failover_failed_requests": sum(n for status, n in result.statuses.items() if status != "200"),
        "failover_statuses": result.statuses,
        "failover_replica_down_s": back - stopped,
        "failover_p99_ms": result.latency_ms.get("p99"),
    }


def _shard_down(layout: LocalLayout, model: str, traffic: Traffic) -> tuple[float, list[int]]:
    dense = layout.dense[0]
    url = f"{dense.inference_url}/predictions/{model}"
    headers = {**dense.auth("inference"), "Content-Type": "application/json"}
    (host,) = layout.shards["b"]
    host.stop()
    times, statuses = [], []
    for body in traffic.bodies[:5]:
        started = time.perf_counter()
        statuses.append(requests.post(url, data=body, headers=headers, timeout=60).status_code)
        times.append((time.perf_counter() - started) * 1000)
    layout.revive("b", 0)
    return float(np.median(times)), statuses


def _ok(response: requests.Response) -> requests.Response:
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.method} {response.url}: {response.status_code} {response.text}")
    return response


def _summary(figures: dict) -> str:
    lines = [f"distributed scenario {figures['scenario']}: shard table MiB {figures['shard_table_mib']}"]
    for key, op, bound in TARGETS:
        value = figures[key]
        met = value >= bound if op == ">=" else value <= bound
        lines.append(f"  {key:<34}{value:>14,.6g}  target {op} {bound:g}: {'met' if met else 'MISSED'}")
    for key in ("single_host_100cand_items_per_s", "di_100cand_items_per_s", "single_host_p50_ms", "di_p50_ms",
                "single_host_p99_ms", "di_p99_ms", "single_host_rss_mib", "shard_rss_mib", "dense_rss_mib",
                "failover_requests", "shard_down_answer_ms", "shard_answer_kib_per_request",
                "shard_answer_kib_per_request_all_bags", "shard_lookups_p50_ms", "shard_handler_ms_per_call"):
        lines.append(f"  {key:<34}{figures[key]:>14,.6g}")
    lines.append(f"  shard_down_statuses {figures['shard_down_statuses']}")
    lines.append("clients (cores; * saturated):")
    for point, client in figures["clients"].items():
        lines.append(f"  {point:<34}{client['client']:>6} {client['cpu_cores']:>6.2f}{'*' if client['saturated'] else ''}")
    return "\n".join(lines) + "\n"


def _plot(figures: dict, path: Path) -> None:
    fig, (speed, latency, memory) = plt.subplots(1, 3, figsize=(13, 4))
    labels = ["one host", "shards + dense"]
    speed.bar(labels, [figures["single_host_100cand_items_per_s"], figures["di_100cand_items_per_s"]], color=["C0", "C1"])
    speed.set_title("100 candidates, concurrency 8: items/s")
    latency.bar(labels, [figures["single_host_p50_ms"], figures["di_p50_ms"]], color=["C0", "C1"])
    latency.set_title("100 candidates, one at a time: p50 ms")
    hosts = {"one host": figures["single_host_rss_mib"], **{f"shard {h}": v for h, v in figures["shard_rss_mib_by_host"].items()},
             "dense": figures["dense_rss_mib"]}
    memory.bar(list(hosts), list(hosts.values()), color=["C0"] + ["C1"] * (len(hosts) - 1))
    memory.set_title("model worker RSS, MiB")
    memory.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{figures['scenario']}: one host vs an embedding-dense layout on loopback")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
