"""The ``raw_ids`` scenarios: a model whose every table takes raw 64-bit ids (TorchRec's MCH
managed collisions), against the same model fed row ids.

    make bench SCENARIO=raw_ids          # the Criteo 1TB row counts (177.9M slots), ~15 min
    make bench SCENARIO=raw_ids-smoke    # tiny, a minute

Two archives are built from one seed (``--init quantized``: the same tables, row for row): the
spec as it is, and the spec with every table ``ids: raw`` (random raw ids over the whole int64
range owning all slots but each table's last). The raw traffic is the row-id traffic with each row
replaced by the raw id that owns it, so both models look up exactly the same rows, and with
``unseen_share`` of its ids replaced by random ids no table has seen. Writes
``benchmarks/results/SCENARIO/raw_ids.json``:

* ``remap_us_per_4k_ids_mch``: in process, one thread, the served remap (``SlotRemap``, the
  graph's arithmetic) of 4,096 ids on the largest table, median of repeats;
* ``p50_overhead_pct``: one item per request at concurrency 1 (``wrk``), the raw-id model's p50
  against the row-id model's, each served alone by the same server in turn, ``rounds`` times
  (the medians of the rounds); ``p50_ms_row_ids``, ``p50_ms_raw_ids`` and each point's client;
* ``unseen_counted``, ``unseen_true``: the unseen ids the server published
  (``HandlerUnseenIds``, all tables) over requests sent once each, against those put in them;
* ``extra_bytes_per_row``: what the raw-id archive's weights hold per slot besides the rows (its
  slot maps' bytes over the slots); ``extra_file_bytes``, ``extra_package_bytes``: its weights file
  and its compiled package (code, compiled archives only) over the row-id archive's, in bytes;
* ``torn_pairs``: scores that saw an id with another id's row while deltas swapped two ids'
  slots under traffic, through TorchServe (``benchmarks.slot_deltas``); ``torn_probe_*``: its size;
* ``mch_swap_s``: moving ``swap_evictions`` slots of the table nearest 10M slots to new raw ids,
  the slot map rebuilt and swapped in as the delta writer does it, in process; ``mch_swap``: the
  same per table (its rebuild, and the ms under the row lock);
* ``remap_us_per_4k_ids_zch``: not measured (``not_measured`` says why): zero-collision hashing is
  not served yet.

Targets: ``p50_overhead_pct`` at most 5; ``unseen_counted`` equal to ``unseen_true``;
``extra_bytes_per_row`` at most 16; ``torn_pairs`` 0; ``mch_swap_s`` at most 2.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
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
from handlers.modeling.raw_ids import SlotRemap
from handlers.modeling.registry import load_spec
from handlers.modeling.spec import ModelSpec
from handlers.runtime.archive_files import WEIGHTS, aoti_weights_file
from handlers.runtime.inputs import MCH_FREE_SLOT
from handlers.runtime.slot_maps import SlotMap, owners_of, slot_maps_in

NOT_MEASURED = {"remap_us_per_4k_ids_zch": "zero-collision hashing (remap kind zch) is not served yet"}


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


RAW_IDS_SCENARIOS = {
    "raw_ids": RawIdsScenario("raw_ids", MODELS / "criteo_1tb.yaml", seconds=8.0, rounds=5, counted_requests=2000),
    "raw_ids-smoke": RawIdsScenario(
        "raw_ids-smoke", MODELS / "tiny.yaml", seconds=1.0, rounds=1, counted_requests=50, artifact="eager",
        probe_table="t_user", probe_publishes=3, swap_tables=("t_user",), swap_evictions=100,
    ),
}


def run_raw_ids(scenario: RawIdsScenario, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    store = out_dir / "model_store"
    shutil.rmtree(store, ignore_errors=True)
    spec = load_spec(scenario.spec)
    raw_spec = raw_ids_spec(spec)
    raw_spec.to_yaml(out_dir / f"{raw_spec.name}.yaml")
    progress = tqdm(total=6, desc=scenario.name, unit="step")
    for name, path in ((spec.name, scenario.spec), (raw_spec.name, out_dir / f"{raw_spec.name}.yaml")):
        progress.set_postfix_str(f"build {name}")
        build(path, store, "--init", "quantized", "--seed", "0", "--artifact", scenario.artifact,
              "--archive-format", "no-archive")
        progress.update()
    weights = {name: weights_file(store / name) for name in (spec.name, raw_spec.name)}
    maps = slot_maps_in(torch.load(weights[raw_spec.name], mmap=True, weights_only=True))
    rows = TrafficModel(items_per_request=1).generate(spec, 512, seed=1)
    raw, unseen_true = raw_traffic(rows, raw_spec, maps, scenario.unseen_share, seed=2)
    progress.set_postfix_str("remap in process")
    largest = max(raw_spec.tables, key=lambda t: t.rows).name
    figures: dict = {"scenario": scenario.name, "spec": spec.name,
                     "remap_us_per_4k_ids_mch": remap_us(maps[largest], seed=3), "remap_table": largest}
    progress.update()
    progress.set_postfix_str("served, c=1")
    counted = len(raw.bodies[: scenario.counted_requests])
    with LocalTorchServe(model_store=store) as server:
        figures.update(_served(server, spec.name, raw_spec.name, rows, raw, scenario))
        progress.update()
        progress.set_postfix_str("torn-pair probe")
        figures.update(torn_pairs(server, raw_spec.name, store / raw_spec.name, weights[raw_spec.name],
                                  scenario.probe_table, scenario.probe_publishes))
    progress.update()
    figures["unseen_true"] = sum(unseen_true[:counted])
    figures["counted_requests"] = counted
    slots = sum(t.rows for t in spec.tables)
    figures["extra_bytes_per_row"] = sum(ids.nbytes + owner.nbytes for ids, owner in maps.values()) / slots
    figures["extra_file_bytes"] = weights[raw_spec.name].stat().st_size - weights[spec.name].stat().st_size
    if scenario.artifact == "aoti":
        packages = [(store / name / "model_aoti.pt2").stat().st_size for name in (raw_spec.name, spec.name)]
        figures["extra_package_bytes"] = packages[0] - packages[1]
    progress.set_postfix_str("slot map swaps")  # last: they change the archive's weights file
    figures["mch_swap"] = {
        table: swap_figures(store / raw_spec.name, weights[raw_spec.name], table, scenario.swap_evictions, seed=4)
        for table in scenario.swap_tables
    }
    figures["mch_swap_s"] = figures["mch_swap"][scenario.swap_tables[0]]["swap_s"]
    figures["not_measured"] = NOT_MEASURED
    progress.update()
    progress.close()
    figures["targets"] = _targets(figures)
    (out_dir / "raw_ids.json").write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
    (out_dir / "summary.txt").write_text(summary(figures))
    print(summary(figures))
    return figures


def raw_ids_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` with every table's ids raw (MCH, LFU), named ``<name>_raw``."""
    tables = [{**t.model_dump(mode="json"), "ids": "raw", "remap": {"kind": "mch"}} for t in spec.tables]
    return spec.replace(name=f"{spec.name}_raw", tables=tables, out_of_range="reject")


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


def remap_us(slot_map: tuple[torch.Tensor, torch.Tensor], seed: int, ids: int = 4096, repeats: int = 300) -> float:
    """Microseconds for the served remap of ``ids`` ids (3 in 4 owned), one thread, median."""
    sorted_ids, slots = slot_map
    remap = SlotRemap(len(slots))
    remap.sorted_ids, remap.slots = sorted_ids, slots
    generator = torch.Generator().manual_seed(seed)
    owned = sorted_ids[sorted_ids != MCH_FREE_SLOT]
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
                remap(query)
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                remap(query)
                times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times) * 1e6


def _served(
    server: LocalTorchServe, row_model: str, raw_model: str, rows: Traffic, raw: Traffic, scenario: RawIdsScenario
) -> dict:
    """c=1 p50 of each model served alone (registered, measured, unregistered, in turn; the raw-id
    model's last registration is left for the torn-pair probe), and the unseen ids the raw-id
    model published over requests sent once each."""
    p50s: dict[str, list[float]] = {row_model: [], raw_model: []}
    clients: dict[str, dict] = {}
    unseen_counted = 0
    auth = server.auth("inference")
    for round_ in range(scenario.rounds):
        for model, traffic in ((row_model, rows), (raw_model, raw)):
            server.register(model, batch_size=1, initial_workers=1).raise_for_status()
            url = f"{server.inference_url}/predictions/{model}"
            run_wrk(url, auth, traffic, 1, scenario.seconds)  # warm-up: the tables' pages mapped in
            result = run_wrk(url, auth, traffic, 1, scenario.seconds)
            p50s[model].append(result.latency_ms["p50"])
            clients[f"{model}_c1_round{round_}"] = result.client_summary()
            if model == raw_model and round_ == 0:
                before = _unseen_published(server, model)
                for body in raw.bodies[: scenario.counted_requests]:
                    server.predict(model, body).raise_for_status()
                unseen_counted = _unseen_published(server, model) - before
            if not (model == raw_model and round_ == scenario.rounds - 1):  # the last stays, for the probe
                server.management("DELETE", f"/models/{model}").raise_for_status()
    row_p50, raw_p50 = statistics.median(p50s[row_model]), statistics.median(p50s[raw_model])
    return {
        "p50_ms_row_ids": row_p50,
        "p50_ms_raw_ids": raw_p50,
        "p50_ms_rounds": p50s,
        "p50_overhead_pct": 100 * (raw_p50 / row_p50 - 1),
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
        target("unseen ids counted exactly", figures["unseen_counted"], "==", figures["unseen_true"]),
        target("extra archive bytes per row (MCH)", figures["extra_bytes_per_row"], "<=", 16.0),
        target("torn id/row pairs under slot deltas", figures["torn_pairs"], "==", 0),
        target(f"MCH slot map swap at {figures['mch_swap'][next(iter(figures['mch_swap']))]['slots']:,} slots, s",
               figures["mch_swap_s"], "<=", 2.0),
    ]


def summary(figures: dict) -> str:
    lines = [f"raw ids scenario {figures['scenario']} ({figures['spec']}, every table raw, MCH)"]
    for key in ("remap_us_per_4k_ids_mch", "p50_ms_row_ids", "p50_ms_raw_ids", "p50_overhead_pct",
                "unseen_counted", "unseen_true", "extra_bytes_per_row", "torn_pairs", "torn_probe_requests",
                "mch_swap_s"):
        lines.append(f"  {key:<28}{figures[key]:>12.3f}" if isinstance(figures[key], float) else
                     f"  {key:<28}{figures[key]:>12}")
    for t in figures["targets"]:
        lines.append(f"  target: {t['target']}: {t['measured']:.3f} {t['op']} {t['bound']:g}: "
                     f"{'met' if t['met'] else 'MISSED'}")
    for key, why in figures["not_measured"].items():
        lines.append(f"  {key}: not measured: {why}")
    return "\n".join(lines) + "\n"
