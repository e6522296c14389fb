"""Where a second intra-op thread starts to pay, served: on this 2-core machine the frontend, the
load generator and the worker share the cores, so an in-process timing (where 2 threads win at any
size) does not say. One archive is served with 1 and with 2 threads at growing request sizes
(closed loop, concurrency 32, batch_size 32), and the items per forward TorchServe formed are read
from the handler's counters.

    .venv/bin/python -m benchmarks.threads [--spec config/models/criteo.yaml] [--out DIR]

Writes threads.json: per request size and thread count, items/s and items per forward; and the
crossover, the smallest items per forward from which 2 threads serve at least 10% more items/s.
The build's ``--parallel-from-items`` default comes from it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import orjson
import yaml

from archive_tools.local_server import LocalTorchServe
from benchmarks.building import build
from benchmarks.load import run_closed_loop
from benchmarks.scenarios import CRITEO_CANDIDATE_FEATURES, MODELS, REPO
from benchmarks.traffic import TrafficModel
from handlers.modeling.registry import load_spec
from handlers.runtime.archive_files import MODEL_CONFIG

REQUEST_SIZES = (1, 4, 16, 64, 100)
GAIN = 1.10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__)
    parser.add_argument("--spec", type=Path, default=MODELS / "criteo.yaml")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "threads")
    parser.add_argument("--seconds", type=float, default=6.0, help="per level")
    args = parser.parse_args(argv)
    spec = load_spec(args.spec)
    results: dict = {"spec": str(args.spec), "levels": []}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "model_store"
        build(args.spec, store, "--artifact", "aoti", "--archive-format", "no-archive", quiet=True)
        config_path = store / spec.name / MODEL_CONFIG
        config = yaml.safe_load(config_path.read_text())
        with LocalTorchServe(model_store=store) as server:
            url = f"{server.inference_url}/predictions/{spec.name}"
            for threads in (1, 2):
                config["handler"].update(intra_op_threads=threads, parallel_from_items=0)
                config_path.write_text(yaml.safe_dump(config))
                assert server.register(spec.name).status_code == 200
                for size in REQUEST_SIZES:
                    model = TrafficModel(items_per_request=size, candidate_features=CRITEO_CANDIDATE_FEATURES)
                    traffic = model.generate(spec, 256, seed=size)
                    run_closed_loop(url, server.auth("inference"), traffic, 8, 2.0, 400)
                    before = server.handler_counters(spec.name)
                    result = run_closed_loop(url, server.auth("inference"), traffic, 32, args.seconds, 10**6)
                    formed = server.handler_counters(spec.name).minus(before)
                    level = {
                        "threads": threads,
                        "items_per_request": size,
                        "items_per_forward": formed.mean_items_per_forward,
                        "items_per_s": result.items_per_s,
                        "p99_ms": result.latency_ms.get("p99"),
                    }
                    results["levels"].append(level)
                    print(level, flush=True)
                server.management("DELETE", f"/models/{spec.name}").raise_for_status()
                time.sleep(1.0)
    by = {(lv["threads"], lv["items_per_request"]): lv for lv in results["levels"]}
    wins = [size for size in REQUEST_SIZES if by[(2, size)]["items_per_s"] >= GAIN * by[(1, size)]["items_per_s"]]
    first = next((s for s in REQUEST_SIZES if all(w in wins for w in REQUEST_SIZES if w >= s)), None)
    results["crossover_items_per_forward"] = round(by[(2, first)]["items_per_forward"]) if first else None
    print("crossover (items per forward):", results["crossover_items_per_forward"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "threads.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
