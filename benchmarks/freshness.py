"""The freshness scenario: a served model kept fresh by deltas while it serves at half its measured
max load, on the real TorchServe with the project's plugin.

    make bench SCENARIO=freshness          # the Criteo 1TB row counts (6 GiB of tables), ~11 min
    make bench SCENARIO=freshness-smoke    # tiny model, a minute (the test suite runs it)

One open loop of one-item requests at 50% of the max load (``reliability.max_load``) runs from
start to end, from ``wrk`` (``benchmarks.wrk_open``, a thread a connection so that each request's
latency counts from its scheduled send); on it, in turn: ``rounds`` times an idle stretch then
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
* ``failed_requests``: non-200 answers over the whole run; ``load_client_cpu_cores``,
  ``load_client_saturated``: the open loop's client (wrk), its CPU in cores and whether it was
  saturated; ``load_achieved_rps``, ``load_late_sends``: the rate it kept, and the requests it sent
  10 ms or more after their schedule (their connection still waited for an answer: a stretch that
  slow shows as late sends and their latency more than as failed requests, ``benchmarks.wrk_open``);
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
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import orjson  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from archive_tools.delta import DeltaSource, make_delta  # noqa: E402
from archive_tools.local_server import LocalTorchServe  # noqa: E402
from benchmarks.building import build  # noqa: E402
from benchmarks.disruptions import ok  # noqa: E402
from benchmarks.freshness_figures import Timeline, measured, plot, summary  # noqa: E402
from benchmarks.reliability import max_load  # noqa: E402
from benchmarks.scenarios import MODELS  # noqa: E402
from benchmarks.stalls import MachineStalls  # noqa: E402
from benchmarks.traffic import TrafficModel  # noqa: E402
from benchmarks.wrk_open import WrkBackgroundLoad  # noqa: E402
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
    load_share: float = 0.5  # the load served throughout, a share of the max load
    # admission control's wait target for both versions' registrations (None: the archive's). The
    # smoke runs beside another test file: when that file takes a core back mid-swap (a compile,
    # a worker starting), version 1 serves slower than the max load measured at the start, and
    # requests shed by the default target would be the neighbour's doing, not the swap's.
    max_queue_wait_ms: int | None = None


FRESHNESS_SCENARIOS = {
    "freshness": FreshnessScenario(
        "freshness", MODELS / "criteo_1tb.yaml",
        ("--init", "quantized", "--archive-format", "no-archive", "--artifact", "aoti"),
        workers=2, deltas=81, rows_per_delta=100_000, rolled_back=5, rounds=4, idle_s=60.0, max_load_step_s=6.0,
    ),
    "freshness-smoke": FreshnessScenario(
        "freshness-smoke", MODELS / "tiny.yaml",
        # eager: an AOTI compile would double its time; deltas into AOTI packages are test_publishing's
        ("--archive-format", "no-archive"),
        workers=2, deltas=6, rows_per_delta=300, rolled_back=3, rounds=1, idle_s=2.0, max_load_step_s=1.0,
        # max-load steps at 25, 62.5 and 100%; the load a tenth of the max (wrk's open loop, which
        # leaves the server more of the cores than the Python client did, finds it higher)
        max_load_step=0.375, load_share=0.1,
        max_queue_wait_ms=5000,  # the test suite runs it beside other tests
    ),
}

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
    timeline = Timeline()
    with LocalTorchServe(model_store=store) as server:
        ok(server.register(archive.name, batch_size=32, max_batch_delay=5, initial_workers=scenario.workers,
                           **_admission(scenario)))
        url = f"{server.inference_url}/predictions/{name}"
        auth = server.auth("inference")
        figures.update(max_load(url, auth, traffic, scenario.max_load_step_s, scenario.max_load_step))
        figures["load_rps"] = rate = scenario.load_share * figures["max_load_rps"]
        progress = tqdm(total=len(deltas) + 2, desc=scenario.name, unit="step")
        with MachineStalls() as stalls, WrkBackgroundLoad(url, auth, traffic, rate, timeline=True) as load:
            memory_before = _server_memory(server)
            _publish_rounds(server, name, scenario, deltas[:-1], timeline, progress)
            memory_after = _server_memory(server)
            figures.update(_dense_swap(server, name, scenario, deltas, timeline))
            progress.update()
            _roll_back(server, name, scenario, len(deltas), timeline)
            progress.update()
            _new_version(server, name, version_2, scenario, timeline)
            progress.update()
        progress.close()
    figures.update(measured(load.result, stalls.found, timeline, scenario.rows_per_delta, memory_before, memory_after))
    (out_dir / "freshness.json").write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
    (out_dir / "summary.txt").write_text(summary(figures))
    spans = timeline.spans
    plot(load.result, timeline.marks, stalls.found, {"idle": timeline.idle, "publishing": timeline.publishing,
          "dense": [spans["dense swap"]], "rollback": [spans["rollback"]], "version": [spans["version swap"]]},
          out_dir / "freshness.png")
    print(summary(figures))
    return figures


def _publish_rounds(
    server: LocalTorchServe, name: str, scenario: FreshnessScenario, deltas: list[Path], timeline: Timeline,
    progress: tqdm,
) -> None:
    """The deltas published in ``scenario.rounds`` groups, each after an idle stretch; each one's
    time from accepted to applied."""
    copy = Path(_state(server, name)["tables_file"]).parent  # the state beside the working copy
    sequence = 0
    for group in np.array_split(np.arange(len(deltas)), scenario.rounds):
        idle_start, cpu = time.perf_counter(), _cpu_busy_s()
        time.sleep(scenario.idle_s / scenario.rounds)
        timeline.idle.append((idle_start, time.perf_counter()))
        timeline.busy["idle"].append((_cpu_busy_s() - cpu, timeline.idle[-1][1] - idle_start))
        publishing_start, cpu = time.perf_counter(), _cpu_busy_s()
        for index in group:
            sequence += 1
            timeline.marks["publish"].append(time.perf_counter())
            _publish(server, name, deltas[index].name)
            accepted = time.perf_counter()
            _wait(lambda: AppliedState.read(copy).sequence >= sequence)
            timeline.visible_s.append(time.perf_counter() - accepted)
            progress.update()
        while time.perf_counter() < publishing_start + MIN_WINDOW_S:  # a p99 needs requests
            time.sleep(POLL_S)
        timeline.publishing.append((publishing_start, time.perf_counter()))
        timeline.busy["publishing"].append((_cpu_busy_s() - cpu, timeline.publishing[-1][1] - publishing_start))


def _dense_swap(
    server: LocalTorchServe, name: str, scenario: FreshnessScenario, deltas: list[Path], timeline: Timeline
) -> dict:
    """The last delta (dense weights) published, until every worker serves it."""
    started = time.perf_counter()
    _publish(server, name, deltas[-1].name)
    accepted = time.perf_counter()
    state = _wait(lambda: _dense_everywhere(server, name, len(deltas), scenario.workers), STATE_POLL_S)
    done = timeline.span("dense swap", started)
    return {"dense_swap_s": done[1] - accepted,
            "dense_swap_worker_s": max(w["dense_swap_s"] for w in state["workers"])}


def _roll_back(server: LocalTorchServe, name: str, scenario: FreshnessScenario, published: int, timeline: Timeline) -> None:
    """Back by ``scenario.rolled_back`` deltas, past the dense one, until applied everywhere."""
    started = time.perf_counter()
    to = published - scenario.rolled_back
    ok(server.management("POST", f"/freshness/{name}", params={"rollback_to": to}))
    _wait(lambda: _state(server, name)["applied_sequence"] == to, STATE_POLL_S)
    _wait(lambda: _dense_everywhere(server, name, 0, scenario.workers), STATE_POLL_S)
    timeline.span("rollback", started)


def _admission(scenario: FreshnessScenario) -> dict:
    return {} if scenario.max_queue_wait_ms is None else {"max_queue_wait_ms": scenario.max_queue_wait_ms}


def _new_version(server: LocalTorchServe, name: str, archive: Path, scenario: FreshnessScenario, timeline: Timeline) -> None:
    """Version 2.0 registered, made the default and 1.0 unregistered, under the same load."""
    started = time.perf_counter()
    ok(server.register(archive.name, initial_workers=scenario.workers, **_admission(scenario)))
    ok(server.management("PUT", f"/models/{name}/2.0/set-default"))
    ok(server.management("DELETE", f"/models/{name}/1.0"))
    timeline.span("version swap", started)
    time.sleep(1.0)


# -- set-up ---------------------------------------------------------------------------------------


def _build(scenario: FreshnessScenario, store: Path) -> Path:
    build(scenario.spec, store, "--seed", "0", *scenario.build_args)
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
