"""python -m benchmarks SCENARIO [--out DIR] [--trace WORKLOAD=FILE ...] [--data FILE]

Runs one scenario of ``benchmarks.scenarios`` against a local TorchServe and writes results.json,
latency_vs_throughput.png, memory_by_table.png and summary.txt to DIR
(default: benchmarks/results/SCENARIO).
"""

from __future__ import annotations

import gc

gc.disable()  # for the scenarios' imports (torch, TorchRec, the pipeline): archive_tools.cli says why

import argparse
import atexit
import sys
from pathlib import Path

from benchmarks.distributed import DISTRIBUTED_SCENARIOS, run_distributed
from benchmarks.engines import ENGINES_SCENARIOS, run_engines
from benchmarks.plan import PLAN_SCENARIOS, run_plan
from benchmarks.raw_ids import RAW_IDS_SCENARIOS, run_raw_ids
from benchmarks.freshness import FRESHNESS_SCENARIOS, run_freshness
from benchmarks.reliability import RELIABILITY_SCENARIOS, run_reliability
from benchmarks.run import run
from benchmarks.scenarios import REPO, SCENARIOS
from benchmarks.sequence import SEQUENCE_SCENARIOS, run_sequence
from benchmarks.speed import SPEED_SCENARIOS, run_speed

gc.freeze()  # what the imports made lives as long as the process
gc.enable()
atexit.register(gc.freeze)  # skipped by the exit's collections (archive_tools.cli says why)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[1])
    parser.add_argument("scenario", choices=sorted({*SCENARIOS, *SPEED_SCENARIOS, *RELIABILITY_SCENARIOS, *FRESHNESS_SCENARIOS, *DISTRIBUTED_SCENARIOS, *SEQUENCE_SCENARIOS, *PLAN_SCENARIOS, *RAW_IDS_SCENARIOS, *ENGINES_SCENARIOS}))
    parser.add_argument("--out", type=Path, help="output folder")
    parser.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="WORKLOAD=FILE",
        help="replay a JSON-lines trace (one request body per line) instead of generated traffic",
    )
    parser.add_argument("--data", type=Path, nargs="+",
                        help="plan: the click log to plan on (Criteo TSV/CSV files, merged; or libfm files)")
    args = parser.parse_args(argv)
    traces = {}
    for item in args.trace:
        workload, _, path = item.partition("=")
        if not path:
            parser.error(f"--trace {item!r}: expected WORKLOAD=FILE")
        traces[workload] = Path(path)
    out = args.out or REPO / "benchmarks" / "results" / args.scenario
    if args.scenario in SPEED_SCENARIOS:
        run_speed(SPEED_SCENARIOS[args.scenario], out)
    elif args.scenario in ENGINES_SCENARIOS:
        run_engines(ENGINES_SCENARIOS[args.scenario], out)
    elif args.scenario in RELIABILITY_SCENARIOS:
        run_reliability(RELIABILITY_SCENARIOS[args.scenario], out)
    elif args.scenario in FRESHNESS_SCENARIOS:
        run_freshness(FRESHNESS_SCENARIOS[args.scenario], out)
    elif args.scenario in SEQUENCE_SCENARIOS:
        run_sequence(args.scenario, out)
    elif args.scenario in PLAN_SCENARIOS:
        run_plan(out, args.data)
    elif args.scenario in RAW_IDS_SCENARIOS:
        run_raw_ids(RAW_IDS_SCENARIOS[args.scenario], out)
    elif args.scenario in DISTRIBUTED_SCENARIOS:
        run_distributed(DISTRIBUTED_SCENARIOS[args.scenario], out)
    else:
        run(SCENARIOS[args.scenario], out, traces)
    return 0


if __name__ == "__main__":
    sys.exit(main())
