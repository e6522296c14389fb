"""Build a TorchServe archive (``model_store/NAME.mar``) from a model spec and trained weights.

    python -m archive_tools.build --spec config/models/tiny.yaml --seed 0
    python -m archive_tools.build --spec config/models/criteo.yaml --checkpoint trained.pt

Stages: spec -> float DLRM (checkpoint, or seeded random weights for demos) -> per-table quantization
(FBGEMM TBE) -> reload exactly as the handler will and compare its scores with the float model's ->
package handler, ``handlers`` package, spec, weights and ``model-config.yaml`` with
``torch-model-archiver``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from archive_tools.synthetic import items_request
from handlers.factory import DLRMFactory
from handlers.service import ScoringService
from handlers.spec import ModelSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
HANDLERS_DIR = REPO_ROOT / "handlers"
HANDLER_FILE = HANDLERS_DIR / "torchserve_handler.py"


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """TorchServe's per-model settings, written to the archive's ``model-config.yaml``."""

    batch_size: int = 32
    max_batch_delay_ms: int = 5
    workers: int = 1
    intra_op_threads: int = 1
    response_timeout_s: int = 60

    def model_config(self, weights_bytes: int) -> dict:
        # Loading is dominated by reading the weights: allow a minute plus 30 s per GB.
        startup_timeout_s = 60 + int(30 * weights_bytes / 2**30)
        return {
            "minWorkers": self.workers,
            "maxWorkers": self.workers,
            "batchSize": self.batch_size,
            "maxBatchDelay": self.max_batch_delay_ms,
            "responseTimeout": self.response_timeout_s,
            "startupTimeout": startup_timeout_s,
            "handler": {
                "spec": "spec.yaml",
                "weights": "weights.pt",
                "intra_op_threads": self.intra_op_threads,
            },
        }


@dataclasses.dataclass(frozen=True)
class VerificationReport:
    items: int
    max_abs_score_diff: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.max_abs_score_diff <= self.bound


def build_archive(
    spec_path: Path,
    *,
    checkpoint: Path | None,
    seed: int,
    name: str | None,
    version: str,
    model_store: Path,
    serving: ServingConfig,
    max_score_diff: float,
    verify_items: int = 256,
) -> Path:
    """Runs every stage and returns the path of the written ``.mar``; raises if verification fails."""
    stages = tqdm(total=5, desc="archive", unit="stage", file=sys.stderr)
    started = time.perf_counter()

    stages.set_postfix_str("spec")
    spec = ModelSpec.from_yaml(spec_path)
    name = name or spec.name
    factory = DLRMFactory(spec)
    stages.update()

    stages.set_postfix_str("float model")
    float_model = factory.float_model(seed=seed)
    if checkpoint is not None:
        factory.load_checkpoint(float_model, DLRMFactory.read_checkpoint(checkpoint))
    stages.update()

    stages.set_postfix_str("quantize")
    weights = factory.quantize(float_model)
    stages.update()

    with tempfile.TemporaryDirectory(prefix=f"{name}-archive-") as tmp:
        staging = Path(tmp) / "extra"
        shutil.copytree(HANDLERS_DIR, staging / "handlers", ignore=shutil.ignore_patterns("__pycache__"))
        spec.to_yaml(staging / "spec.yaml")
        factory.save_weights(weights, staging / "weights.pt")
        weights_bytes = (staging / "weights.pt").stat().st_size
        config_path = Path(tmp) / "model-config.yaml"
        config_path.write_text(yaml.safe_dump(serving.model_config(weights_bytes), sort_keys=False))

        stages.set_postfix_str("verify")
        report = verify(spec, float_model, staging, verify_items, max_score_diff, seed)
        tqdm.write(
            f"verification: {report.items} items, max |score - float score| = "
            f"{report.max_abs_score_diff:.2e} (bound {report.bound:.0e}): "
            + ("ok" if report.passed else "FAILED"),
            file=sys.stderr,
        )
        if not report.passed:
            stages.close()
            raise RuntimeError(
                f"refusing to write {name}.mar: quantized scores differ from the float model's by "
                f"{report.max_abs_score_diff:.3e} > {max_score_diff:.0e}"
            )
        stages.update()

        stages.set_postfix_str("torch-model-archiver")
        model_store.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                str(Path(sys.executable).parent / "torch-model-archiver"),
                "--model-name", name,
                "--version", version,
                "--handler", str(HANDLER_FILE),
                "--extra-files", str(staging),
                "--config-file", str(config_path),
                "--export-path", str(model_store),
                "--force",
            ],
            check=True,
        )
        stages.update()
    stages.close()
    archive = model_store / f"{name}.mar"
    tqdm.write(
        f"wrote {archive} ({archive.stat().st_size / 2**20:.1f} MiB; weights "
        f"{weights_bytes / 2**20:.1f} MiB) in {time.perf_counter() - started:.1f}s",
        file=sys.stderr,
    )
    return archive


def verify(
    spec: ModelSpec,
    float_model: torch.nn.Module,
    staging: Path,
    num_items: int,
    bound: float,
    seed: int,
) -> VerificationReport:
    """Loads the staged spec and weights as the handler does and compares scores with the float model."""
    served = ScoringService.from_files(staging / "spec.yaml", staging / "weights.pt")
    reference = ScoringService(spec, float_model)
    request = served.decoder.decode(items_request(spec, num_items, seed=seed + 1)).inputs
    served_scores = torch.sigmoid(served.logits([request])[0])
    float_scores = torch.sigmoid(reference.logits([request])[0])
    diff = float((served_scores - float_scores).abs().max())
    return VerificationReport(items=num_items, max_abs_score_diff=diff, bound=bound)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m archive_tools.build",
        description="Build a TorchServe .mar for a TorchRec DLRM: quantize, verify, package.",
    )
    parser.add_argument("--spec", type=Path, required=True, help="model spec YAML (config/models/)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", type=Path, help="trained float state dict (torch.save)")
    weights.add_argument("--seed", type=int, default=0, help="random weights from this seed (demo)")
    parser.add_argument("--name", help="model name (default: the spec's name)")
    parser.add_argument("--version", default="1.0", help="model version (default: 1.0)")
    parser.add_argument("--model-store", type=Path, default=REPO_ROOT / "model_store")
    parser.add_argument("--batch-size", type=int, default=ServingConfig.batch_size)
    parser.add_argument("--max-batch-delay", type=int, default=ServingConfig.max_batch_delay_ms, help="ms")
    parser.add_argument("--workers", type=int, default=ServingConfig.workers)
    parser.add_argument("--intra-op-threads", type=int, default=ServingConfig.intra_op_threads)
    parser.add_argument(
        "--max-score-diff",
        type=float,
        default=0.02,
        help="refuse the archive if any verification score differs from the float model's by more",
    )
    args = parser.parse_args(argv)
    build_archive(
        args.spec,
        checkpoint=args.checkpoint,
        seed=args.seed,
        name=args.name,
        version=args.version,
        model_store=args.model_store,
        serving=ServingConfig(
            batch_size=args.batch_size,
            max_batch_delay_ms=args.max_batch_delay,
            workers=args.workers,
            intra_op_threads=args.intra_op_threads,
        ),
        max_score_diff=args.max_score_diff,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
