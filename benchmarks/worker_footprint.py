"""What a worker pays to load an archive: import time, load time, memory and the packages it
imported, each measured in a fresh process that loads the archive as a TorchServe worker does
(the archive's own copy of the handler, initialized with the archive's model-config.yaml).

    .venv/bin/python -m benchmarks.worker_footprint model_store/criteo.mar [--runs 3]

Prints one JSON line per run and the median of each figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import MODEL_CONFIG

_PROBE = textwrap.dedent("""
    import json, os, sys, time
    folder = sys.argv[1]
    sys.path.insert(0, folder)
    os.chdir(folder)
    import psutil, yaml
    started = time.perf_counter()
    import torchserve_handler  # the archive's copy, importing the archive's handlers package
    imported = time.perf_counter()

    class Context:  # what TorchServe hands initialize()
        system_properties = {"model_dir": folder, "gpu_id": None}
        model_yaml_config = yaml.safe_load(open(os.path.join(folder, sys.argv[2])))
        model_name = "footprint"
        manifest: dict = {}

    torchserve_handler.DLRMHandler().initialize(Context())
    loaded = time.perf_counter()
    memory = psutil.Process().memory_full_info()
    print(json.dumps({
        "import_s": imported - started,
        "initialize_s": loaded - imported,
        "rss_mib": memory.rss / 2**20,
        "uss_mib": memory.uss / 2**20,
        "modules": len(sys.modules),
        "torchrec": "torchrec" in sys.modules,
        "torchao": "torchao" in sys.modules,
    }))
""")


def measure(archive: Path, runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="footprint-") as tmp, Archive.open(archive) as opened:
        folder = opened.unpacked()
        results = []
        for _ in range(runs):
            done = subprocess.run(
                [sys.executable, "-c", _PROBE, str(folder), MODEL_CONFIG],
                capture_output=True, text=True, check=True, cwd=tmp,
            )
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]))
    return {
        key: statistics.median(r[key] for r in results) if isinstance(results[0][key], float) else results[0][key]
        for key in results[0]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker_footprint", description=__doc__)
    parser.add_argument("archive", type=Path, help="a .mar or an unzipped archive folder")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    print("median:", json.dumps(measure(args.archive, args.runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
