"""Forward time of each artifact kind, in-process, one run:

    python -m benchmarks.artifacts [--spec config/models/criteo.yaml] [--out DIR]

Eager float (the trained model), eager quantized (TorchRec + FBGEMM on the mapped weights), the
exported program, the AOTInductor package and the split model (sparse and dense parts as graphs of
their own: compiled, exported or eager lookups on the mapped tables, each before a compiled dense
part), at batch 1, 32, 256 and 2048 items, on one intra-op thread; plus each archive's size, build
time, and what a user sees when registering it: the synchronous register call's time to ready and
the worker's own load time (from its describe answer), with TorchServe's config. Every package is
compiled (the compile cache is off). Writes artifacts.json, artifacts.png
and a text table to DIR (default benchmarks/results/artifacts).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import orjson  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from archive_tools.build import build_archive  # noqa: E402
from archive_tools.compile_cache import CACHE_ENV  # noqa: E402
from archive_tools.model_config import ServingConfig  # noqa: E402
from archive_tools.local_server import LocalTorchServe  # noqa: E402
from benchmarks.scenarios import MODELS, REPO  # noqa: E402
from handlers.loading import load_service  # noqa: E402
from handlers.modeling.eager import eager_service  # noqa: E402
from handlers.modeling.factory import DLRMFactory  # noqa: E402
from handlers.modeling.registry import load_spec, synthetic_request  # noqa: E402
from handlers.modeling.spec import ModelSpec  # noqa: E402
from handlers.runtime.archive import Archive  # noqa: E402
from handlers.runtime.artifacts import Artifact  # noqa: E402
from handlers.runtime.batching import Batch, coalesce  # noqa: E402
from handlers.runtime.options import HandlerOptions  # noqa: E402
from handlers.runtime.service import ScoringService  # noqa: E402
from handlers.runtime.split import SplitPlan  # noqa: E402

BATCHES = (1, 32, 256, 2048)


def forward_ms(model, batch, min_time_s: float = 1.0) -> float:
    with torch.inference_mode():
        for _ in range(3):
            model(batch)
        calls, started = 0, time.perf_counter()
        while time.perf_counter() - started < min_time_s or calls < 5:
            model(batch)
            calls += 1
    return (time.perf_counter() - started) / calls * 1000


KINDS = {
    "eager quantized": (Artifact.EAGER, None),
    "exported": (Artifact.EXPORTED, None),
    "aoti": (Artifact.AOTI, None),
    "split aoti+aoti": (Artifact.SPLIT, SplitPlan(Artifact.AOTI, Artifact.AOTI)),
    "split exp+aoti": (Artifact.SPLIT, SplitPlan(Artifact.EXPORTED, Artifact.AOTI)),
    "split eager+aoti": (Artifact.SPLIT, SplitPlan(Artifact.EAGER, Artifact.AOTI)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.artifacts", description=__doc__)
    parser.add_argument("--spec", type=Path, default=MODELS / "criteo.yaml")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "artifacts")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = "off"  # build_s: each package compiled, not copied from the compile cache
    torch.set_num_threads(1)
    spec = load_spec(args.spec)
    probe = eager_service(spec, DLRMFactory(spec).float_model(seed=0))
    batches = _batches(spec, probe)
    results: dict = {"spec": str(args.spec), "batches": list(BATCHES), "artifacts": {}}
    progress = tqdm(total=len(KINDS) + 1, desc="artifacts", unit="kind")
    results["artifacts"]["eager float"] = {
        "forward_ms": {size: forward_ms(probe.model, batch) for size, batch in batches.items()}
    }
    progress.update()
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "model_store"
        store.mkdir()
        with LocalTorchServe(store) as server:
            for index, (label, (kind, split)) in enumerate(KINDS.items()):
                progress.set_postfix_str(label)
                archive = store / f"{spec.name}_{index}.mar"
                results["artifacts"][label] = _measure(server, args.spec, archive, kind, split, batches)
                progress.update()
    progress.close()
    options = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
    (args.out / "artifacts.json").write_bytes(orjson.dumps(results, option=options))
    text = _table(results)
    (args.out / "artifacts.txt").write_text(text)
    print(text)
    _plot(results, spec.name, args.out / "artifacts.png")
    return 0


def _batches(spec: ModelSpec, probe: ScoringService) -> dict[int, Batch]:
    """One batch of each size in ``BATCHES``: requests of at most 256 items, coalesced."""
    batches = {}
    for size in BATCHES:
        parts = [min(256, size - start) for start in range(0, size, 256)]
        requests = [probe.decoder.decode(synthetic_request(spec, n, seed=k)).inputs for k, n in enumerate(parts)]
        batches[size] = coalesce(requests, probe.tags)
    return batches


def _measure(
    server: LocalTorchServe, spec_path: Path, archive: Path, kind: Artifact, split: SplitPlan | None,
    batches: dict[int, Batch],
) -> dict:
    """Builds ``archive`` as ``kind``; times its build, its registration, its load in this process
    and its forwards."""
    started = time.perf_counter()
    build_archive(spec_path, checkpoint=None, seed=0, name=archive.stem, version="1.0", model_store=archive.parent,
                  serving=ServingConfig(), artifact=kind, split=split)
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    server.register(archive.name, initial_workers=1).raise_for_status()
    register_s = time.perf_counter() - started
    described = server.management("GET", f"/models/{archive.stem}", params={"customized": "true"})
    worker = described.json()[0]["customizedMetadata"]
    server.management("DELETE", f"/models/{archive.stem}").raise_for_status()
    with Archive.open(archive) as opened:
        folder = opened.unpacked()
        started = time.perf_counter()
        service = load_service(folder, HandlerOptions(kind, split))
        load_s = time.perf_counter() - started
        forwards = {size: forward_ms(service.model, batch) for size, batch in batches.items()}
    return {
        "archive_mib": archive.stat().st_size / 2**20,
        "build_s": build_s,
        "load_s": load_s,
        "register_s": register_s,
        "worker_load_s": worker["load_s"],
        "forward_ms": forwards,
    }


def _table(results: dict) -> str:
    lines = [f"{'artifact':<18}" + "".join(f"{f'batch {b} ms':>14}" for b in BATCHES)
             + f"{'archive MiB':>13}{'build s':>9}{'register s':>12}{'worker load s':>15}"]
    for label, r in results["artifacts"].items():
        lines.append(
            f"{label:<18}" + "".join(f"{r['forward_ms'][b]:>14.3f}" for b in BATCHES)
            + (f"{r['archive_mib']:>13.1f}{r['build_s']:>9.1f}{r['register_s']:>12.2f}"
               f"{r['worker_load_s']:>15.2f}" if "build_s" in r else "")
        )
    return "\n".join(lines) + "\n"


def _plot(results: dict, model: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, r in results["artifacts"].items():
        ax.plot(BATCHES, [r["forward_ms"][b] for b in BATCHES], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("items per forward")
    ax.set_ylabel("forward time (ms), 1 thread")
    ax.set_title(f"{model}: forward time by artifact")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
