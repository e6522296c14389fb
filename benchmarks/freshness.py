"""The freshness scenario: a served model kept fresh by deltas while it serves at half its measured
max load, on the real TorchServe with the project's plugin.

    make bench SCENARIO=freshness          # the Criteo 1TB row counts (6 GiB of tables), ~11 min
    make bench SCENARIO=freshness-smoke    # tiny model, a minute (the test suite runs it)

One open loop of one-item requests at 50% of the max load (``reliability.max_load``) runs from
start to end, from a process of its own; on it, in turn: ``rounds`` times an idle stretch then
deltas of ``rows_per_delta`` random rows (from rows files, through ``torchrec-serve delta``)
published one after another, each as soon as the one before is visible (idle and publishing
alternate so that whatever else slows the machine now and then falls on both alike); a delta of
new dense weights only; a rollback of the last deltas (dense weights included); a version
transition (register 2.0, set it default, unregister 1.0). Writes
``benchmarks/results/SCENARIO/freshness.json``:

* ``rows_per_min``: rows applied (visible to every worker: they map the same tables) per minute
  over the publishing stretches, first POST to last delta visible;
* ``publish_to_visible_p50_s``, ``publish_to_visible_p99_s``: POST answered (the delta is in the
  log) -> the applied sequence past it, polled every 20 ms from the state file of the tables'
  working copy (what ``GET /freshness`` reports as ``applied_sequence``; that call is answered by a
  worker, and polling it would put the benchmark's own calls on the serving path);
* ``serving_p99_ms_idle``, ``serving_p99_ms_during``, ``serving_p99_ratio``: the load's p99 over
  the idle stretches, and over the publishing stretches (each at least 2 s);
* ``typical_second_p99_ms_idle``, ``typical_second_p99_ms_during``: the median over those seconds
  of each second's p99, which a stall of the machine in one second does not move;
* ``machine_stalls``: ``[second of the run, ms]`` of each stall of the machine itself, seen by a
  process that only sleeps (``benchmarks.stalls``); ``machine_stalls_idle``,
  ``machine_stalls_during``: how many fell in the idle and in the publishing stretches;
  ``serving_p99_ms_idle_outside_stalls``, ``serving_p99_ms_during_outside_stalls``,
  ``serving_p99_ratio_outside_stalls``: the p99s again without the requests in flight during one;
* ``cpu_busy_cores_idle``, ``cpu_busy_cores_during``: the machine's CPU time in use (user, system
  and interrupts, every process), in cores, over the idle and over the publishing stretches;
* ``failed_requests``: non-200 answers over the whole run;
* ``rss_growth_mib``: the server's anonymous memory (frontend and workers, ``RssAnon``), after the
  publishing against before; mapped table pages that the writer touched are page cache, shared
  and reclaimable, and reported apart (``rss_total_growth_mib``) next to the bytes of the deltas;
* ``dense_swap_s`` (POST answered -> every worker serves the new dense weights),
  ``dense_swap_worker_s`` (the slowest worker's own swap), ``dense_swap_failed_requests``;
* ``rollback_s``, ``rollback_failed_requests``;
* ``version_swap_s``, ``version_swap_failed_requests``, ``version_swap_p99_ms``: version 2.0 is
  the same archive under another version (its files hard links of 1.0's: no second 6 GiB on
  disk), so the figure is TorchServe's transition itself.

``freshness.png``: the p99 of each second over the run, each publish and machine stall marked.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import orjson  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from archive_tools.delta import DeltaSource, make_delta  # noqa: E402
from archive_tools.local_server import LocalTorchServe  # noqa: E402
from benchmarks.load import BackgroundLoad, LoadResult, run_closed_loop  # noqa: E402
from benchmarks.disruptions import ok  # noqa: E402
from benchmarks.reliability import max_load  # noqa: E402
from benchmarks.scenarios import MODELS  # noqa: E402
from benchmarks.stalls import MachineStalls, overlaps  # noqa: E402
from benchmarks.traffic import TrafficModel  # noqa: E402
from handlers.modeling.factory import DLRMFactory  # noqa: E402
from handlers.modeling.registry import load_spec  # noqa: E402
from handlers.modeling.spec import ModelSpec  # noqa: E402
from handlers.runtime.freshness.applier import AppliedState  # noqa: E402

POLL_S = 0.02
STATE_POLL_S = 0.1
MIN_WINDOW_S = 2.0  # the shortest stretch a p99 is taken over (the smoke's deltas apply in less)


@dataclasses.dataclass(frozen=True)
class FreshnessScenario:
    name: str
    spec: Path
    build_args: tuple[str, ...]
    workers: int
    deltas: int
    rows_per_delta: int
    rolled_back: int  # deltas undone by the rollback (the dense one among them)
    rounds: int  # idle, then publishing, this many times
    idle_s: float  # in all
    max_load_step_s: float
    max_load_step: float = 0.05  # the search's step, a share of the closed loop's rate


FRESHNESS_SCENARIOS = {
    "freshness": FreshnessScenario(
        "freshness", MODELS / "criteo_1tb.yaml",
        ("--init", "quantized", "--archive-format", "no-archive", "--artifact", "aoti"),
        workers=2, deltas=81, rows_per_delta=100_000, rolled_back=5, rounds=4, idle_s=60.0, max_load_step_s=6.0,
    ),
    "freshness-smoke": FreshnessScenario(
        "freshness-smoke", MODELS / "tiny.yaml",
        ("--archive-format", "no-archive", "--artifact", "aoti"),
        workers=2, deltas=6, rows_per_delta=300, rolled_back=3, rounds=2, idle_s=3.0, max_load_step_s=1.0,
        max_load_step=0.25,
    ),
}

TARGETS = (  # (key, bound: a number or the key it is compared with, factor)
    ("rows_per_min", ">=", 2_000_000),
    ("publish_to_visible_p99_s", "<=", 2.0),
    ("serving_p99_ratio", "<=", 1.1),
    ("failed_requests", "<=", 0),
    ("dense_swap_failed_requests", "<=", 0),
    ("version_swap_failed_requests", "<=", 0),
    ("rollback_failed_requests", "<=", 0),
    ("rss_growth_mib", "<=", "delta_mib"),
)


def run_freshness(scenario: FreshnessScenario, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = load_spec(scenario.spec)
    store = out_dir / "model_store"
    shutil.rmtree(store, ignore_errors=True)
    archive = _build(scenario, store)
    version_2 = _second_version(archive)
    deltas = _make_deltas(scenario, spec, archive, store / "deltas")
    traffic = TrafficModel(items_per_request=1).generate(spec, 512, seed=1)
    name = spec.name
    figures: dict = {"scenario": scenario.name, "workers": scenario.workers, "rows_per_delta": scenario.rows_per_delta,
                     "delta_mib": sum(d.stat().st_size for d in deltas[:-1]) / 2**20}
    marks: dict[str, list[float]] = {"publish": []}
    idle: list[tuple[float, float]] = []
    publishing: list[tuple[float, float]] = []
    visible_s: list[float] = []
    busy: dict[str, list[tuple[float, float]]] = {"idle": [], "publishing": []}  # (CPU seconds, seconds)
    with LocalTorchServe(model_store=store) as server:
        ok(server.register(archive.name, batch_size=32, max_batch_delay=5, initial_workers=scenario.workers))
        url = f"{server.inference_url}/predictions/{name}"
        auth = server.auth("inference")
        run_closed_loop(url, auth, traffic, 8, 2.0, 10**6)  # warm-up
        figures.update(max_load(url, auth, traffic, scenario.max_load_step_s, scenario.max_load_step))
        rate = 0.5 * figures["max_load_rps"]
        figures["load_rps"] = rate
        progress = tqdm(total=len(deltas) + 2, desc=scenario.name, unit="step")
        with MachineStalls() as stalls, BackgroundLoad(url, auth, traffic, rate) as load:
            memory_before = _server_memory(server)
            copy = Path(_state(server, name)["tables_file"]).parent  # the state beside the working copy
            sequence = 0
            for group in np.array_split(np.arange(len(deltas) - 1), scenario.rounds):
                idle_start, cpu = time.perf_counter(), _cpu_busy_s()
                time.sleep(scenario.idle_s / scenario.rounds)
                idle.append((idle_start, time.perf_counter()))
                busy["idle"].append((_cpu_busy_s() - cpu, idle[-1][1] - idle_start))
                publishing_start, cpu = time.perf_counter(), _cpu_busy_s()
                for index in group:
                    sequence += 1
                    marks["publish"].append(time.perf_counter())
                    _publish(server, name, deltas[index].name)
                    accepted = time.perf_counter()
                    _wait(lambda: AppliedState.read(copy).sequence >= sequence)
                    visible_s.append(time.perf_counter() - accepted)
                    progress.update()
                while time.perf_counter() < publishing_start + MIN_WINDOW_S:  # a p99 needs requests
                    time.sleep(POLL_S)
                publishing.append((publishing_start, time.perf_counter()))
                busy["publishing"].append((_cpu_busy_s() - cpu, publishing[-1][1] - publishing_start))
            memory_after = _server_memory(server)

            dense_at = time.perf_counter()
            marks["dense swap"] = [dense_at]
            _publish(server, name, deltas[-1].name)
            dense_accepted = time.perf_counter()
            state = _wait(lambda: _dense_everywhere(server, name, len(deltas), scenario.workers), STATE_POLL_S)
            dense = (dense_at, time.perf_counter())
            figures["dense_swap_s"] = dense[1] - dense_accepted
            figures["dense_swap_worker_s"] = max(w["dense_swap_s"] for w in state["workers"])
            progress.update()

            rollback_at = time.perf_counter()
            marks["rollback"] = [rollback_at]
            to = len(deltas) - scenario.rolled_back
            ok(server.management("POST", f"/freshness/{name}", params={"rollback_to": to}))
            _wait(lambda: _state(server, name)["applied_sequence"] == to, STATE_POLL_S)
            _wait(lambda: _dense_everywhere(server, name, 0, scenario.workers), STATE_POLL_S)
            rollback = (rollback_at, time.perf_counter())
            progress.update()

            swap_at = time.perf_counter()
            marks["version swap"] = [swap_at]
            ok(server.register(version_2.name, initial_workers=scenario.workers))
            ok(server.management("PUT", f"/models/{name}/2.0/set-default"))
            ok(server.management("DELETE", f"/models/{name}/1.0"))
            swap = (swap_at, time.perf_counter())
            time.sleep(1.0)
            progress.update()
        progress.close()

    result = load.result
    figures.update({
        "rows_per_min": 60 * scenario.rows_per_delta * len(visible_s) / sum(b - a for a, b in publishing),
        "publish_to_visible_p50_s": float(np.percentile(visible_s, 50)),
        "publish_to_visible_p99_s": float(np.percentile(visible_s, 99)),
        "publish_to_visible_s": visible_s,
        "serving_p99_ms_idle": _p99_ms(result, *idle),
        "serving_p99_ms_during": _p99_ms(result, *publishing),
        "typical_second_p99_ms_idle": _typical_second_p99_ms(result, idle),
        "typical_second_p99_ms_during": _typical_second_p99_ms(result, publishing),
        "machine_stalls": [[float(at - result.events[0][0]), late * 1000] for at, late in stalls.found],
        "machine_stalls_idle": sum(1 for at, _ in stalls.found if any(a <= at < b for a, b in idle)),
        "machine_stalls_during": sum(1 for at, _ in stalls.found if any(a <= at < b for a, b in publishing)),
        "serving_p99_ms_idle_outside_stalls": _p99_ms(result, *idle, stalls=stalls.found),
        "serving_p99_ms_during_outside_stalls": _p99_ms(result, *publishing, stalls=stalls.found),
        "cpu_busy_cores_idle": sum(c for c, _ in busy["idle"]) / sum(s for _, s in busy["idle"]),
        "cpu_busy_cores_during": sum(c for c, _ in busy["publishing"]) / sum(s for _, s in busy["publishing"]),
        "failed_requests": _failed(result, result.events[0][0], float("inf")),
        "statuses": result.statuses,
        "rss_growth_mib": memory_after["anon_mib"] - memory_before["anon_mib"],
        "rss_total_growth_mib": memory_after["rss_mib"] - memory_before["rss_mib"],
        "memory_before": memory_before,
        "memory_after": memory_after,
        "dense_swap_failed_requests": _failed(result, *dense),
        "rollback_s": rollback[1] - rollback[0],
        "rollback_failed_requests": _failed(result, *rollback),
        "version_swap_s": swap[1] - swap[0],
        "version_swap_failed_requests": _failed(result, swap[0], swap[1] + 1.0),
        "version_swap_p99_ms": _p99_ms(result, (swap[0], swap[1] + 1.0)),
    })
    figures["serving_p99_ratio"] = figures["serving_p99_ms_during"] / figures["serving_p99_ms_idle"]
    figures["serving_p99_ratio_outside_stalls"] = (
        figures["serving_p99_ms_during_outside_stalls"] / figures["serving_p99_ms_idle_outside_stalls"])
    (out_dir / "freshness.json").write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
    (out_dir / "summary.txt").write_text(_summary(figures))
    _plot(result, marks, stalls.found, {"idle": idle, "publishing": publishing, "dense": [dense], "rollback": [rollback],
                          "version": [swap]}, out_dir / "freshness.png")
    print(_summary(figures))
    return figures


# -- set-up ---------------------------------------------------------------------------------------


def _build(scenario: FreshnessScenario, store: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "archive_tools", "build", "--spec", str(scenario.spec), "--seed", "0",
         "--model-store", str(store), *scenario.build_args],
        check=True,
    )
    (archive,) = [p for p in store.iterdir() if p.is_dir()]
    return archive


def _second_version(archive: Path) -> Path:
    """The archive as version 2.0: hard links of its files, a manifest of its own."""
    copy = archive.with_name(f"{archive.name}-v2")
    shutil.copytree(archive, copy, copy_function=os.link)
    manifest = copy / "MAR-INF" / "MANIFEST.json"
    data = orjson.loads(manifest.read_bytes())
    data["model"]["modelVersion"] = "2.0"
    manifest.unlink()  # a link to 1.0's manifest: write a file of its own
    manifest.write_bytes(orjson.dumps(data))
    return copy


def _make_deltas(scenario: FreshnessScenario, spec: ModelSpec, archive: Path, folder: Path) -> list[Path]:
    """``scenario.deltas`` deltas of random rows (ids drawn over all tables by their sizes), then
    one of new dense weights alone."""
    folder.mkdir(parents=True)
    generator = np.random.default_rng(0)
    sizes = np.array([t.rows for t in spec.tables])
    deltas = []
    for sequence in tqdm(range(1, scenario.deltas + 1), desc="deltas", unit="delta"):
        counts = generator.multinomial(scenario.rows_per_delta, sizes / sizes.sum())
        while any(c > t.rows for c, t in zip(counts, spec.tables)):  # a tiny table drew too many
            counts = generator.multinomial(scenario.rows_per_delta, sizes / sizes.sum())
        rows = {
            t.name: {"ids": torch.from_numpy(generator.choice(t.rows, size=c, replace=False)),
                     "rows": torch.from_numpy(generator.uniform(-0.05, 0.05, (c, t.dim)).astype(np.float32))}
            for t, c in zip(spec.tables, counts) if c
        }
        rows_file = folder / f"rows-{sequence}.pt"
        torch.save(rows, rows_file)
        deltas.append(make_delta(archive, DeltaSource(rows=rows_file), folder / f"rows-{sequence:04d}.delta", sequence).path)
        rows_file.unlink()
    dense_file = folder / "dense.pt"
    torch.save(DLRMFactory(spec).random_dense(seed=1), dense_file)
    deltas.append(make_delta(archive, DeltaSource(dense=dense_file), folder / "dense.delta", scenario.deltas + 1).path)
    return deltas


# -- the server -----------------------------------------------------------------------------------


def _publish(server: LocalTorchServe, name: str, delta: str) -> None:
    ok(server.management("POST", f"/freshness/{name}", params={"delta": delta}))


def _state(server: LocalTorchServe, name: str) -> dict:
    return ok(server.management("GET", f"/freshness/{name}")).json()


def _dense_everywhere(server: LocalTorchServe, name: str, sequence: int, workers: int) -> dict | None:
    """The state once every one of ``workers`` workers serves delta ``sequence``'s dense weights."""
    state = _state(server, name)
    serving = [w.get("dense_sequence") for w in state["workers"]]
    return state if serving == [sequence] * workers else None


def _wait(condition, every_s: float = POLL_S, timeout_s: float = 120.0):  # type: ignore[no-untyped-def]
    """``condition()`` once true; ``every_s``: how often it is asked (a ``GET /freshness`` is
    answered by a worker: asked as an operator would, every ``STATE_POLL_S``)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"not within {timeout_s}s")


def _cpu_busy_s() -> float:
    """The machine's CPU seconds in use so far, every core and process (``/proc/stat``)."""
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + times.irq + times.softirq


def _server_memory(server: LocalTorchServe) -> dict[str, float]:
    """The frontend's and workers' resident memory: all of it, and its anonymous part."""
    rss = anon = 0
    root = psutil.Process(server.process.pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss += int(fields["VmRSS"].split()[0])
        anon += int(fields["RssAnon"].split()[0])
    return {"rss_mib": rss / 1024, "anon_mib": anon / 1024}


# -- figures --------------------------------------------------------------------------------------


def _in(result: LoadResult, start: float, end: float) -> list[tuple[float, float, str]]:
    return [e for e in result.events if start <= e[0] < end]


def _latencies_ms(
    result: LoadResult, spans: tuple[tuple[float, float], ...], stalls: Sequence[tuple[float, float]] = ()
) -> list[tuple[float, float]]:
    """(sent, latency in ms) of the requests sent within ``spans`` and answered 200, leaving out
    those in flight during one of ``stalls``."""
    return [(sent, (answered - sent) * 1000) for start, end in spans
            for sent, answered, status in _in(result, start, end)
            if status == "200" and not overlaps(stalls, sent, answered)]


def _p99_ms(result: LoadResult, *spans: tuple[float, float], stalls: Sequence[tuple[float, float]] = ()) -> float:
    latencies = [ms for _, ms in _latencies_ms(result, spans, stalls)]
    if not latencies:
        raise RuntimeError(f"no request answered 200 in the {sum(b - a for a, b in spans):.2f} s measured")
    return float(np.percentile(latencies, 99))


def _typical_second_p99_ms(result: LoadResult, spans: list[tuple[float, float]]) -> float:
    """The median over the seconds of ``spans`` of each second's p99."""
    by_second: dict[int, list[float]] = {}
    for sent, ms in _latencies_ms(result, tuple(spans)):
        by_second.setdefault(int(sent), []).append(ms)
    return float(np.median([np.percentile(ms, 99) for ms in by_second.values()]))


def _failed(result: LoadResult, start: float, end: float) -> int:
    return sum(1 for _, _, status in _in(result, start, end) if status != "200")


def _summary(figures: dict) -> str:
    lines = [f"freshness scenario {figures['scenario']}: {figures['workers']} workers, "
             f"{figures['load_rps']:.0f} req/s (50% of max load {figures['max_load_rps']:.0f})"]
    for key, op, bound in TARGETS:
        value = figures[key]
        limit = figures[bound] if isinstance(bound, str) else bound
        met = value >= limit if op == ">=" else value <= limit
        lines.append(f"  {key:<32}{_fmt(value):>14}  target {op} {bound} ({_fmt(limit)}): {'met' if met else 'MISSED'}")
    for key in ("publish_to_visible_p50_s", "serving_p99_ms_idle", "serving_p99_ms_during", "typical_second_p99_ms_idle",
                "typical_second_p99_ms_during", "machine_stalls_idle", "machine_stalls_during",
                "serving_p99_ms_idle_outside_stalls", "serving_p99_ms_during_outside_stalls",
                "serving_p99_ratio_outside_stalls", "cpu_busy_cores_idle", "cpu_busy_cores_during", "rss_total_growth_mib",
                "dense_swap_s", "dense_swap_worker_s", "rollback_s", "version_swap_s", "version_swap_p99_ms"):
        lines.append(f"  {key:<32}{_fmt(figures[key]):>14}")
    return "\n".join(lines) + "\n"


def _fmt(value: object) -> str:
    return f"{value:,.3f}" if isinstance(value, float) else f"{value:,}"


def _plot(
    result: LoadResult,
    marks: dict[str, list[float]],
    stalls: list[tuple[float, float]],
    spans: dict[str, list[tuple[float, float]]],
    path: Path,
) -> None:
    start = result.events[0][0]
    sent = np.array([e[0] - start for e in result.events if e[2] == "200"])
    latency = np.array([(e[1] - e[0]) * 1000 for e in result.events if e[2] == "200"])
    seconds = np.floor(sent).astype(int)
    bins = np.unique(seconds)
    p99 = [np.percentile(latency[seconds == s], 99) for s in bins]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.plot(bins, p99, linewidth=1, color="black", label="p99 of each second")
    colors = {"idle": "#dddddd", "publishing": "#cfe3f7", "dense": "#f7e0c3", "rollback": "#e3d3f2", "version": "#d3f2d9"}
    for label, stretches in spans.items():
        for index, (a, b) in enumerate(stretches):
            ax.axvspan(a - start, b - start, color=colors[label], label=label if index == 0 else None)
    for t in marks["publish"]:
        ax.axvline(t - start, color="tab:blue", linewidth=0.4)
    if stalls:
        ax.plot([at - start for at, _ in stalls], [late * 1000 for _, late in stalls], "v", color="tab:red",
                markersize=5, label="machine stall (ms late)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("p99 latency, ms")
    ax.set_title("serving p99 while deltas are published (blue lines), dense weights swapped, rolled back, "
                 "and the version changed; the machine's own stalls in red", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
