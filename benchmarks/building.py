"""How the benchmarks build their archives: ``torchrec-serve build`` in a process of its own, as a
user runs it (its peak memory is then the child's, apart from the benchmark's own)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def build(spec: Path, store: Path, *args: str, quiet: bool = False, env: dict[str, str] | None = None) -> None:
    """``torchrec-serve build --spec SPEC --model-store STORE ARGS...``; ``quiet``: its output kept
    back (shown only if it fails, in the raised error); ``env``: the build's environment (default
    this process's)."""
    command = [sys.executable, "-m", "archive_tools", "build", "--spec", str(spec), "--model-store", str(store), *args]
    done = subprocess.run(command, capture_output=quiet, text=True, env=env)
    if done.returncode != 0:
        kept = f":\n{done.stdout[-2000:]}{done.stderr[-3000:]}" if quiet else " (its output is above)"
        raise RuntimeError(f"building {spec} failed with exit status {done.returncode}{kept}")
