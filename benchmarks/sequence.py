"""The ``sequence`` scenario: the DIN example (a user's own architecture, installed as a package)
served as an AOTInductor package, 100 candidates per request, each request with a history of 50
to 500 items sent once; served against the in-process ceiling at the batches TorchServe formed.

    make bench SCENARIO=sequence

Writes ``benchmarks/results/sequence/sequence.json``: ``items_per_s``, ``p50_ms``, ``p99_ms`` (wrk,
closed loop), ``ceiling_items_per_s`` (the archive's handler in process at the same batches),
``served_vs_ceiling``, ``mean_history_length``, ``max_score_diff_batched_vs_solo`` (each of 32
requests sent alone, then all at once into shared forwards: ``batched_requests_per_forward``),
``client`` (wrk's CPU); targets:
served at least 0.85 of the ceiling, batched vs solo at most 1e-5. Also ``summary.txt`` and
``sequence.png``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import orjson  # noqa: E402
from tqdm import tqdm  # noqa: E402

from archive_tools.local_server import LocalTorchServe  # noqa: E402
from archive_tools.model_config import ServingConfig  # noqa: E402
from benchmarks.building import build  # noqa: E402
from benchmarks.inprocess import CeilingProcess  # noqa: E402
from benchmarks.traffic import Traffic  # noqa: E402
from benchmarks.wrk import run_wrk  # noqa: E402

from din_ranker.data import user_request  # noqa: E402  isort: skip
from din_ranker.train import SPEC  # noqa: E402  isort: skip

SEQUENCE_SCENARIOS = ("sequence", "sequence-smoke")
CANDIDATES = 100
HISTORY = (50, 500)
TARGET_SERVED_VS_CEILING = 0.85
TARGET_BATCHED_VS_SOLO = 1e-5


def run_sequence(name: str, out_dir: Path) -> dict:
    smoke = name.endswith("smoke")
    seconds, concurrency, batch_size = (2.0, 4, 4) if smoke else (20.0, 8, 8)
    out_dir.mkdir(parents=True, exist_ok=True)
    traffic, histories = _traffic(64 if smoke else 256, seed=1)
    progress = tqdm(total=5, desc=name, unit="step")
    progress.set_postfix_str("build (aoti)")
    archive = _build(out_dir / "model_store", batch_size)
    progress.update()
    with LocalTorchServe(model_store=archive.parent) as server:
        registered = server.register(archive.name, initial_workers=1, batch_size=batch_size, max_batch_delay=5)
        registered.raise_for_status()
        url, auth = f"{server.inference_url}/predictions/din", server.auth("inference")
        progress.set_postfix_str("batched vs solo")
        max_diff, coalesced = _batched_vs_solo(server, traffic)
        progress.update()
        progress.set_postfix_str(f"closed loop c={concurrency}")
        run_wrk(url, auth, traffic, concurrency, 2.0)  # warm-up
        before = server.handler_counters("din")
        load = run_wrk(url, auth, traffic, concurrency, seconds)
        formed = server.handler_counters("din").minus(before)
        progress.update()
    progress.set_postfix_str("in-process ceiling")
    with CeilingProcess(archive, {"din": traffic}, ServingConfig.intra_op_threads) as ceiling:
        per_batch = max(1, round(formed.mean_requests_per_batch))  # the batches the server formed
        ceiling_items_per_s = ceiling.items_per_s("din", per_batch, 0.3 if smoke else 2.0)
    progress.update()
    figures = {
        "scenario": name,
        "items_per_s": load.items_per_s,
        "ceiling_items_per_s": ceiling_items_per_s,
        "served_vs_ceiling": load.items_per_s / ceiling_items_per_s,
        "p50_ms": load.latency_ms["p50"],
        "p99_ms": load.latency_ms["p99"],
        "mean_history_length": float(np.mean(histories)),
        "max_score_diff_batched_vs_solo": max_diff,
        "batched_requests_per_forward": coalesced,  # during the batched half of that comparison
        "candidates_per_request": CANDIDATES,
        "concurrency": concurrency,
        "batch_size": batch_size,
        "formed_requests_per_batch": formed.mean_requests_per_batch,
        "statuses": load.statuses,
        "client": load.client_summary(),
    }
    served_share = figures["served_vs_ceiling"]
    figures["targets"] = {
        f"served >= {TARGET_SERVED_VS_CEILING} of the ceiling": served_share >= TARGET_SERVED_VS_CEILING,
        f"batched vs solo <= {TARGET_BATCHED_VS_SOLO}": max_diff <= TARGET_BATCHED_VS_SOLO,
    }
    (out_dir / "sequence.json").write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
    summary = _summary(figures)
    (out_dir / "summary.txt").write_text(summary)
    _plot(figures, out_dir / "sequence.png")
    progress.update()
    progress.close()
    print(summary)
    return figures


def _traffic(count: int, seed: int) -> tuple[Traffic, list[int]]:
    """``count`` requests of 100 candidates, histories uniform in [50, 500]."""
    rng = np.random.default_rng(seed)
    histories = rng.integers(HISTORY[0], HISTORY[1] + 1, size=count).tolist()
    bodies = [orjson.dumps(user_request(rng, h, CANDIDATES)[0]) for h in histories]
    return Traffic(bodies, [CANDIDATES] * count), histories


def _build(store: Path, batch_size: int) -> Path:
    build(SPEC, store, "--seed", "0", "--artifact", "aoti", "--archive-format", "no-archive",
          "--batch-size", str(batch_size))
    return store / "din"


def _batched_vs_solo(server: LocalTorchServe, traffic: Traffic, count: int = 32) -> tuple[float, float]:
    """Each of ``count`` requests alone, then all at once: the largest score change, and the
    requests per forward the second time (more than 1: they were coalesced)."""
    bodies = traffic.bodies[:count]
    solo = [server.predict("din", body).json()["scores"] for body in bodies]
    before = server.handler_counters("din")
    with ThreadPoolExecutor(max_workers=count) as pool:
        together = list(pool.map(lambda body: server.predict("din", body).json()["scores"], bodies))
    formed = server.handler_counters("din").minus(before)
    return float(max(np.abs(np.array(a) - np.array(b)).max() for a, b in zip(solo, together))), formed.mean_requests_per_batch


def _summary(figures: dict) -> str:
    client = figures["client"]
    lines = [
        f"{figures['scenario']}: DIN, {figures['candidates_per_request']} candidates per request, histories "
        f"{HISTORY[0]}-{HISTORY[1]} (mean {figures['mean_history_length']:.0f}), batch_size {figures['batch_size']}, "
        f"c={figures['concurrency']}",
        f"  served {figures['items_per_s']:,.0f} items/s (p50 {figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms; "
        f"{figures['formed_requests_per_batch']:.1f} requests per forward; wrk {client['cpu_cores']:.3f} cores)",
        f"  in-process ceiling {figures['ceiling_items_per_s']:,.0f} items/s: served/ceiling {figures['served_vs_ceiling']:.2f}",
        f"  max |batched - solo| {figures['max_score_diff_batched_vs_solo']:.2e} "
        f"({figures['batched_requests_per_forward']:.1f} requests per forward when batched)",
    ]
    lines += [f"  target {'met' if met else 'MISSED'}: {label}" for label, met in figures["targets"].items()]
    return "\n".join(lines) + "\n"


def _plot(figures: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.2))
    labels = ["served", "in-process ceiling"]
    ax.bar(labels, [figures["items_per_s"], figures["ceiling_items_per_s"]], color=["tab:blue", "tab:gray"])
    ax.set_ylabel("items/s (100 candidates per request)")
    ax.set_title(f"DIN, histories {HISTORY[0]}-{HISTORY[1]}: served {figures['served_vs_ceiling']:.2f} of ceiling")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
