"""One item per request at c=32 in the items form and in TorchServe's DLRM example form, for one or
more archives registered side by side on one TorchServe, in alternating rounds: an A/B whose
ratios hold on a shared machine, where absolute figures move with the neighbours' load.

Each worker imports the ``handlers`` its own archive carries (the server is started with an empty
``PYTHONPATH``, which TorchServe would put before the archive's folder), so archives built from two
commits compare the two handlers (before and after a change) on one server:

    git worktree add /tmp/before COMMIT
    (cd /tmp/before && python -m archive_tools build --spec config/models/criteo.yaml \\
        --model-store /tmp/ab --artifact aoti) && mv /tmp/ab/criteo.mar /tmp/ab/before.mar
    python -m archive_tools build --spec config/models/criteo.yaml --model-store /tmp/ab --artifact aoti
    python -m benchmarks.forms /tmp/ab before criteo --rounds 4 --seconds 8

Prints, per round and point: items/s, p50 and p99, and the workers' CPU per item. The first round
runs on a cold frontend (its JVM compiles for about 15 s): read the rounds after it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from archive_tools.local_server import LocalTorchServe
from benchmarks.scenarios import MODELS
from benchmarks.traffic import TrafficModel
from benchmarks.worker_cpu import worker_cpu_s
from benchmarks.wrk import run_wrk
from handlers.modeling.registry import input_schema, load_spec


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.forms", description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path, help="the model store holding the archives")
    parser.add_argument("archives", nargs="+", help="archive names in the store (NAME.mar)")
    parser.add_argument("--spec", type=Path, default=MODELS / "criteo.yaml", help="the archives' spec")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0, help="per point")
    args = parser.parse_args(argv)
    spec = load_spec(args.spec)
    items = TrafficModel(items_per_request=1).generate(spec, 512, seed=1)
    forms = {"items": items, "example": items.as_example_form(input_schema(spec))}
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    # The workers' PYTHONPATH is the environment's, then the archive's folder: emptied, each worker
    # imports its own archive's ``handlers``, not a checkout's.
    with LocalTorchServe(model_store=args.store, env={"PYTHONPATH": ""}) as server:
        auth = server.auth("inference")
        for name in args.archives:
            server.register(f"{name}.mar", model_name=name, batch_size=32, max_batch_delay=5).raise_for_status()
        for round_ in range(args.rounds):
            for name in args.archives:
                for form, traffic in forms.items():
                    url = f"{server.inference_url}/predictions/{name}"
                    run_wrk(url, auth, traffic, 4, 1.0)  # warm-up
                    before = worker_cpu_s(server.process.pid)
                    result = run_wrk(url, auth, traffic, 32, args.seconds)
                    cpu_us = (worker_cpu_s(server.process.pid) - before) / max(1, result.items) * 1e6
                    print(
                        f"round {round_} {name:>12} {form:>8}: {result.items_per_s:7,.0f} items/s, "
                        f"p50 {result.latency_ms['p50']:.2f} ms, p99 {result.latency_ms['p99']:.2f} ms, "
                        f"workers {cpu_us:4.0f} us/item, load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
