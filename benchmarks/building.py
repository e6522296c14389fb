"""How the benchmarks build their archives: ``torchrec-serve build`` in a process of its own, as a
user runs it (its peak memory is then the child's, apart from the benchmark's own); and the no-op
handler's archive (``noop.mar``, TorchServe's floor) with torch-model-archiver."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

NOOP_HANDLER = Path(__file__).resolve().parent / "noop_handler.py"
NOOP = "noop"  # the no-op archive's model name


def build(spec: Path, store: Path, *args: str, quiet: bool = False, env: dict[str, str] | None = None) -> None:
    """``torchrec-serve build --spec SPEC --model-store STORE ARGS...``; ``quiet``: its output kept
    back (shown only if it fails, in the raised error); ``env``: the build's environment (default
    this process's)."""
    command = [sys.executable, "-m", "archive_tools", "build", "--spec", str(spec), "--model-store", str(store), *args]
    done = subprocess.run(command, capture_output=quiet, text=True, env=env)
    if done.returncode != 0:
        kept = f":\n{done.stdout[-2000:]}{done.stderr[-3000:]}" if quiet else " (its output is above)"
        raise RuntimeError(f"building {spec} failed with exit status {done.returncode}{kept}")


def build_noop(store: Path) -> Path:
    """``STORE/noop.mar``: ``benchmarks/noop_handler.py`` as a TorchServe archive."""
    store.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-c", "from model_archiver.model_packaging import generate_model_archive "
         "as main; main()", "--model-name", NOOP, "--version", "1.0", "--handler",
         str(NOOP_HANDLER), "--export-path", str(store), "--force"],
        check=True,
    )
    return store / f"{NOOP}.mar"
