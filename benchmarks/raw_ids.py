"""The ``raw_ids`` scenarios: a model whose every table takes raw 64-bit ids (TorchRec's managed
collisions: MCH, and again zero-collision hashing, ZCH), against the same model fed row ids.

    make bench SCENARIO=raw_ids          # the Criteo 1TB row counts (177.9M slots), ~25 min
    make bench SCENARIO=raw_ids-smoke    # tiny, a minute

Three archives are built from one seed (``--init quantized``: the same tables, row for row): the
spec as it is, and the spec with every table ``ids: raw``, MCH (random raw ids over the whole int64
range owning all slots but each table's last) and ZCH (as many random ids as slots inserted by
probing: about 96.5% of the slots get one). The raw traffic is the row-id traffic with each row
replaced by the raw id that owns it, so the models look up exactly the same rows, and with
``unseen_share`` of its ids (and a free row's) replaced by random ids no table has seen. Writes
``benchmarks/results/SCENARIO/raw_ids.json``:

* ``remap_us_per_4k_ids_mch`` / ``_zch``: in process, one thread, the served remap (``RawIdRemaps``
  of that table alone, eager: the graph's arithmetic) of 4,096 ids (3 in 4 owned) on the largest table,
  median of repeats;
* ``p50_overhead_pct`` (MCH) / ``p50_overhead_pct_zch``: one item per request at concurrency 1
  (``wrk``), the raw-id model's p50 against the row-id model's, each served alone by the same
  server in turn, ``rounds`` times, every other round in the reverse order (the medians of the
  rounds); ``p50_ms_row_ids``,
  ``p50_ms_raw_ids``, ``p50_ms_zch_ids`` and each point's client;
* ``unseen_counted``, ``unseen_true`` (MCH; ``_zch``: ZCH): the unseen ids the server published
  (``HandlerUnseenIds``, all tables) over requests sent once each, against those put in them;
* ``extra_bytes_per_row`` (MCH) / ``extra_bytes_per_row_zch``: what a raw-id archive's weights hold
  per slot besides the rows (its slot maps' bytes over the slots); ``extra_file_bytes``,
  ``extra_package_bytes``: the MCH weights file and compiled package (code, compiled archives
  only) over the row-id archive's, in bytes;
* ``torn_pairs`` (MCH) / ``torn_pairs_zch``: scores that saw an id with another id's row while
  deltas swapped two ids' slots under traffic, through TorchServe (``benchmarks.slot_deltas``);
  ``torn_probe_*``: its size;
* ``mch_swap_s``: moving ``swap_evictions`` slots of the table nearest 10M slots to new raw ids,
  the slot map rebuilt and swapped in as the delta writer does it, in process; ``mch_swap``: the
  same per table (its rebuild, and the ms under the row lock); ``zch_swap``: the same on the ZCH
  archive (each new id in the slot its probing starts at).

Targets: ``p50_overhead_pct`` at most 5; ``unseen_counted`` equal to ``unseen_true``;
``extra_bytes_per_row`` at most 16 (ZCH: 8); ``torn_pairs`` 0; ``mch_swap_s`` at most 2.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson
import torch
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from archive_tools.local_server import LocalTorchServe
from benchmarks.building import build
from benchmarks.scenarios import MODELS
from benchmarks.slot_deltas import swap_figures, torn_pairs
from benchmarks.traffic import Traffic, TrafficModel
from benchmarks.wrk import run_wrk
from handlers.modeling.raw_ids import served_remap
from handlers.modeling.registry import load_spec
from handlers.modeling.spec import ModelSpec, TableSpec
from handlers.runtime.archive_files import WEIGHTS, aoti_weights_file
from handlers.runtime.inputs import MCH_FREE_SLOT
from handlers.runtime.slot_maps import SlotMap, owners_of, slot_maps_in


@dataclasses.dataclass(frozen=True)
class RawIdsScenario:
    name: str
    spec: Path
    seconds: float  # each c=1 point, after as long again of warm-up (a registration maps its tables anew)
    rounds: int  # row-id and raw-id points, in turn
    counted_requests: int  # sent once each, for the unseen counts
    unseen_share: float = 0.05  # of the raw traffic's ids, replaced by ids no table has seen
    artifact: str = "aoti"  # what both archives serve (the smoke: eager, seconds to build)
    probe_table: str = "t_cat_1"  # two of its slots swap owners under traffic (torn pairs)
    probe_publishes: int = 20
    swap_tables: tuple[str, ...] = ("t_cat_20", "t_cat_19")  # the first gives mch_swap_s (11.3M slots)
    swap_evictions: int = 10_000
    parallel_builds: int = 1  # archives built at once (each build of the full size takes GiBs)


RAW_IDS_SCENARIOS = {
    "raw_ids": RawIdsScenario("raw_ids", MODELS / "criteo_1tb.yaml", seconds=8.0, rounds=7, counted_requests=2000),
    "raw_ids-smoke": RawIdsScenario(
        "raw_ids-smoke", MODELS / "tiny.yaml", seconds=0.5, rounds=1, counted_requests=50, artifact="eager",
        probe_table="t_user", probe_publishes=2, swap_tables=("t_user",), swap_evictions=100, parallel_builds=3,
    ),
}


def run_raw_ids(scenario: RawIdsScenario, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    store = out_dir / "model_store"
    shutil.rmtree(store, ignore_errors=True)
    spec = load_spec(scenario.spec)
    raw_specs = {kind: raw_ids_spec(spec, kind) for kind in ("mch", "zch")}
    progress = tqdm(total=7, desc=scenario.name, unit="step")
    paths = {spec.name: scenario.spec}
    for raw_spec in raw_specs.values():
        paths[raw_spec.name] = out_dir / f"{raw_spec.name}.yaml"
        raw_spec.to_yaml(paths[raw_spec.name])
    progress.set_postfix_str("build")

    def build_one(path: Path) -> None:
        build(path, store, "--init", "quantized", "--seed", "0", "--artifact", scenario.artifact,
              "--archive-format", "no-archive", quiet=scenario.parallel_builds > 1)
        progress.update()

    with ThreadPoolExecutor(scenario.parallel_builds) as builds:  # child processes
        list(builds.map(build_one, paths.values()))
    weights = {name: weights_file(store / name) for name in paths}
    rows = TrafficModel(items_per_request=1).generate(spec, 512, seed=1)
    maps, traffic, unseen_true = {}, {spec.name: rows}, {}
    for kind, raw_spec in raw_specs.items():
        maps[kind] = slot_maps_in(torch.load(weights[raw_spec.name], mmap=True, weights_only=True))
        traffic[raw_spec.name], unseen_true[kind] = raw_traffic(rows, raw_spec, maps[kind], scenario.unseen_share, seed=2)
    progress.set_postfix_str("remap in process")
    largest = max(spec.tables, key=lambda t: t.rows).name
    figures: dict = {"scenario": scenario.name, "spec": spec.name, "remap_table": largest}
    for kind, raw_spec in raw_specs.items():
        table = next(t for t in raw_spec.tables if t.name == largest)
        figures[f"remap_us_per_4k_ids_{kind}"] = remap_us(table, maps[kind][largest], seed=3)
    progress.update()
    progress.set_postfix_str("served, c=1")
    counted = len(rows.bodies[: scenario.counted_requests])
    mch, zch = raw_specs["mch"].name, raw_specs["zch"].name
    with LocalTorchServe(model_store=store) as server:
        served = _served(server, {spec.name: rows, zch: traffic[zch], mch: traffic[mch]}, (zch, mch), scenario)
        progress.update()
        progress.set_postfix_str("torn-pair probes")
        figures.update(torn_pairs(server, mch, store / mch, weights[mch], scenario.probe_table, scenario.probe_publishes))
        probe = torn_pairs(server, zch, store / zch, weights[zch], scenario.probe_table, scenario.probe_publishes)
        figures.update({f"{key}_zch": value for key, value in probe.items()})
    progress.update()
    p50 = served.pop("p50_ms")
    figures.update({
        "p50_ms_row_ids": p50[spec.name], "p50_ms_raw_ids": p50[mch], "p50_ms_zch_ids": p50[zch],
        "p50_overhead_pct": 100 * (p50[mch] / p50[spec.name] - 1),
        "p50_overhead_pct_zch": 100 * (p50[zch] / p50[spec.name] - 1),
        "unseen_counted": served["unseen_counted"][mch], "unseen_true": sum(unseen_true["mch"][:counted]),
        "unseen_counted_zch": served["unseen_counted"][zch], "unseen_true_zch": sum(unseen_true["zch"][:counted]),
        "p50_ms_rounds": served["p50_ms_rounds"], "clients": served["clients"], "counted_requests": counted,
    })
    slots = sum(t.rows for t in spec.tables)
    figures["extra_bytes_per_row"] = sum(p.nbytes for m in maps["mch"].values() for p in m) / slots
    figures["extra_bytes_per_row_zch"] = sum(p.nbytes for m in maps["zch"].values() for p in m) / slots
    figures["extra_file_bytes"] = weights[mch].stat().st_size - weights[spec.name].stat().st_size
    if scenario.artifact == "aoti":
        packages = [(store / name / "model_aoti.pt2").stat().st_size for name in (mch, spec.name)]
        figures["extra_package_bytes"] = packages[0] - packages[1]
    progress.set_postfix_str("slot map swaps")  # last: they change the archive's weights file
    table_of = {kind: {t.name: t for t in raw_spec.tables} for kind, raw_spec in raw_specs.items()}
    figures["mch_swap"] = {
        table: swap_figures(store / mch, weights[mch], table_of["mch"][table], scenario.swap_evictions, seed=4)
        for table in scenario.swap_tables
    }
    figures["mch_swap_s"] = figures["mch_swap"][scenario.swap_tables[0]]["swap_s"]
    figures["zch_swap"] = {
        table: swap_figures(store / zch, weights[zch], table_of["zch"][table], scenario.swap_evictions, seed=4)
        for table in scenario.swap_tables
    }
    progress.update()
    progress.close()
    figures["targets"] = _targets(figures)
    (out_dir / "raw_ids.json").write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
    (out_dir / "summary.txt").write_text(summary(figures))
    print(summary(figures))
    return figures


def raw_ids_spec(spec: ModelSpec, kind: str) -> ModelSpec:
    """``spec`` with every table's ids raw, remapped by ``kind`` (``mch``: LFU; ``zch``: its
    defaults), named ``<name>_raw`` (MCH) or ``<name>_zch``."""
    tables = [{**t.model_dump(mode="json"), "ids": "raw", "remap": {"kind": kind}} for t in spec.tables]
    return spec.replace(name=f"{spec.name}_{'raw' if kind == 'mch' else kind}", tables=tables, out_of_range="reject")


def weights_file(archive: Path) -> Path:
    """The file that holds an archive folder's tables and slot maps."""
    package = archive / "model_aoti.pt2"
    return aoti_weights_file(package) if package.exists() else archive / WEIGHTS


def raw_traffic(
    rows: Traffic, raw_spec: ModelSpec, maps: dict[str, SlotMap], unseen_share: float, seed: int
) -> tuple[Traffic, list[int]]:
    """``rows``'s requests with each row id replaced by the raw id that owns that row (a free
    row's, or ``unseen_share`` of all, by a random id no table has seen); and how many ids of
    each request are unseen."""
    rng = np.random.default_rng(seed)
    table_of = {f: t.name for t in raw_spec.tables for f in t.features}
    owners = {table: owners_of(served).numpy() for table, served in maps.items()}
    owned = {table: np.sort(ids[ids != MCH_FREE_SLOT]) for table, ids in owners.items()}
    bodies, unseen = [], []
    for body in rows.bodies:
        request, count = orjson.loads(body), 0
        for item in request["items"]:
            for feature, ids in item["sparse"].items():
                raw = owners[table_of[feature]][np.asarray(ids, dtype=np.int64)]
                fresh = (raw == MCH_FREE_SLOT) | (rng.random(len(raw)) < unseen_share)
                raw[fresh] = _unseen_ids(int(fresh.sum()), owned[table_of[feature]], rng)
                item["sparse"][feature] = raw.tolist()
                count += int(fresh.sum())
        bodies.append(orjson.dumps(request))
        unseen.append(count)
    return Traffic(bodies=bodies, items=list(rows.items)), unseen


def _unseen_ids(count: int, owned: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``count`` random int64 ids that own no slot of the table (``owned``: its owners, sorted)."""
    ids = rng.integers(-(2**63), MCH_FREE_SLOT, size=count, dtype=np.int64)
    while True:
        taken = owned[np.minimum(np.searchsorted(owned, ids), len(owned) - 1)] == ids
        if not taken.any():
            return ids
        ids[taken] = rng.integers(-(2**63), MCH_FREE_SLOT, size=int(taken.sum()), dtype=np.int64)


def remap_us(table: TableSpec, slot_map: SlotMap, seed: int, ids: int = 4096, repeats: int = 300) -> float:
    """Microseconds for ``table``'s served remap of ``ids`` ids (3 in 4 owned), one thread, median."""
    remap = served_remap(table)
    remap.load({table.name: slot_map})
    generator = torch.Generator().manual_seed(seed)
    owners = owners_of(slot_map)
    owned = owners[owners != MCH_FREE_SLOT]
    query = torch.where(
        torch.rand(ids, generator=generator) < 0.75,
        owned[torch.randint(0, len(owned), (ids,), generator=generator)],
        torch.randint(-(2**63), MCH_FREE_SLOT, (ids,), generator=generator),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for _ in range(20):
                remap.first_feature(query)
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                remap.first_feature(query)
                times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times) * 1e6


def _served(server: LocalTorchServe, traffic: dict[str, Traffic], counted: tuple[str, ...], scenario: RawIdsScenario) -> dict:
    """c=1 p50 of each model served alone: registered, measured and unregistered in turn, in
    the order of ``traffic`` in even rounds and the reverse in odd ones (no model always follows
    the same one); the unseen ids each ``counted`` model published over requests sent once each
    (first round); then the ``counted`` models registered again, for the torn-pair probes."""
    p50s: dict[str, list[float]] = {model: [] for model in traffic}
    clients: dict[str, dict] = {}
    unseen_counted = {}
    auth = server.auth("inference")
    for round_ in range(scenario.rounds):
        for model in list(traffic) if round_ % 2 == 0 else list(traffic)[::-1]:
            bodies = traffic[model]
            server.register(model, batch_size=1, initial_workers=1).raise_for_status()
            url = f"{server.inference_url}/predictions/{model}"
            run_wrk(url, auth, bodies, 1, scenario.seconds)  # warm-up: the tables' pages mapped in
            result = run_wrk(url, auth, bodies, 1, scenario.seconds)
            p50s[model].append(result.latency_ms["p50"])
            clients[f"{model}_c1_round{round_}"] = result.client_summary()
            if model in counted and round_ == 0:
                before = _unseen_published(server, model)
                for body in bodies.bodies[: scenario.counted_requests]:
                    server.predict(model, body).raise_for_status()
                unseen_counted[model] = _unseen_published(server, model) - before
            server.management("DELETE", f"/models/{model}").raise_for_status()
    for model in counted:
        server.register(model, batch_size=1, initial_workers=1).raise_for_status()
    return {
        "p50_ms": {model: statistics.median(points) for model, points in p50s.items()},
        "p50_ms_rounds": p50s,
        "unseen_counted": unseen_counted,
        "clients": clients,
    }


def _unseen_published(server: LocalTorchServe, model: str) -> int:
    return int(sum(
        sample.value
        for family in text_string_to_metric_families(server.scrape(model))
        if family.name == "HandlerUnseenIds"
        for sample in family.samples
        if sample.labels.get("ModelName") == model
    ))


def _targets(figures: dict) -> list[dict]:
    def target(label: str, measured: float, op: str, bound: float) -> dict:
        met = measured <= bound if op == "<=" else measured == bound
        return {"target": label, "measured": measured, "op": op, "bound": bound, "met": met}

    return [
        target("served p50 overhead of raw ids at c=1, %", figures["p50_overhead_pct"], "<=", 5.0),
        target("served p50 overhead of raw ids at c=1, ZCH, %", figures["p50_overhead_pct_zch"], "<=", 5.0),
        target("unseen ids counted exactly", figures["unseen_counted"], "==", figures["unseen_true"]),
        target("unseen ids counted exactly, ZCH", figures["unseen_counted_zch"], "==", figures["unseen_true_zch"]),
        target("extra archive bytes per row (MCH)", figures["extra_bytes_per_row"], "<=", 16.0),
        target("extra archive bytes per row (ZCH)", figures["extra_bytes_per_row_zch"], "<=", 8.0),
        target("torn id/row pairs under slot deltas", figures["torn_pairs"], "==", 0),
        target("torn id/row pairs under slot deltas, ZCH", figures["torn_pairs_zch"], "==", 0),
        target(f"MCH slot map swap at {figures['mch_swap'][next(iter(figures['mch_swap']))]['slots']:,} slots, s",
               figures["mch_swap_s"], "<=", 2.0),
    ]


def summary(figures: dict) -> str:
    lines = [f"raw ids scenario {figures['scenario']} ({figures['spec']}, every table raw: MCH, then ZCH)"]
    for key in ("remap_us_per_4k_ids_mch", "remap_us_per_4k_ids_zch", "p50_ms_row_ids", "p50_ms_raw_ids",
                "p50_ms_zch_ids", "p50_overhead_pct", "p50_overhead_pct_zch", "unseen_counted", "unseen_true",
                "unseen_counted_zch", "unseen_true_zch", "extra_bytes_per_row", "extra_bytes_per_row_zch",
                "torn_pairs", "torn_probe_requests", "torn_pairs_zch", "torn_probe_requests_zch", "mch_swap_s"):
        lines.append(f"  {key:<28}{figures[key]:>12.3f}" if isinstance(figures[key], float) else
                     f"  {key:<28}{figures[key]:>12}")
    for t in figures["targets"]:
        lines.append(f"  target: {t['target']}: {t['measured']:.3f} {t['op']} {t['bound']:g}: "
                     f"{'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines) + "\n"
