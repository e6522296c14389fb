"""Build a TorchServe archive (``model_store/NAME.mar``) from a model spec and trained weights.

    python -m archive_tools.build --spec config/models/tiny.yaml --seed 0
    python -m archive_tools.build --spec config/models/criteo.yaml --checkpoint trained.pt
    python -m archive_tools.build --spec config/models/criteo_1tb.yaml --init quantized \
        --archive-format no-archive --artifact aoti
    python -m archive_tools.build --spec config/models/criteo.yaml --artifact split --sparse eager \
        --dense aoti

Stages: spec -> float model (checkpoint, or seeded random weights for demos) -> per-table quantization
(FBGEMM TBE) -> capture (``--artifact``: the whole model, or its sparse and dense parts, as exported
programs or AOTInductor packages; ``archive_tools.capture``) -> reload exactly as the handler will
and compare its scores with the float model's -> package handler, ``handlers`` package, spec, the
artifact's files and ``model-config.yaml`` with ``torch-model-archiver``.

``--init quantized`` skips the float model: seeded random tables are created straight in their
served dtypes (for models too large to hold in float), and verification checks that the reloaded
artifact scores exactly as the model that was built (run on its saved, memory-mapped weights).
``--archive-format no-archive`` writes a folder instead of a zipped ``.mar``: nothing to compress at
build or unpack at register, for models of many GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from archive_tools.capture import capture, check_capturable
from archive_tools.verification import Bounds, ValidationData, verify
from handlers.export import Artifact
from handlers.factory import DLRMFactory
from handlers.options import HandlerOptions
from handlers.service import ScoringService
from handlers.spec import ModelSpec
from handlers.split import DENSE_ARTIFACTS, DEVICES, SPARSE_ARTIFACTS, SplitPlan

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

    def model_config(self, artifact: Artifact, weights_bytes: int, split: SplitPlan | None) -> dict:
        # Loading is dominated by reading the weights: allow a minute plus 30 s per GB.
        startup_timeout_s = 60 + int(30 * weights_bytes / 2**30)
        return {
            "minWorkers": self.workers,
            "maxWorkers": self.workers,
            "batchSize": self.batch_size,
            "maxBatchDelay": self.max_batch_delay_ms,
            "responseTimeout": self.response_timeout_s,
            "startupTimeout": startup_timeout_s,
            "handler": HandlerOptions(artifact, split, self.intra_op_threads).to_mapping(),
        }


ARCHIVE_FORMATS = ("default", "no-archive")


class VerificationFailed(RuntimeError):
    """The served artifact does not predict like the model it was made from; nothing was written."""


def build_archive(
    spec_path: Path,
    *,
    checkpoint: Path | None,
    seed: int,
    name: str | None,
    version: str,
    model_store: Path,
    serving: ServingConfig,
    bounds: Bounds = Bounds(),
    validation: Path | None = None,
    quantized_init: bool = False,
    archive_format: str = "default",
    artifact: Artifact = Artifact.EAGER,
    split: SplitPlan | None = None,
) -> Path:
    """Runs every stage and returns the path of the written ``.mar`` (or folder, for
    ``no-archive``); raises if verification fails. ``split``: the parts of a ``split`` artifact."""
    if quantized_init and checkpoint is not None:
        raise ValueError("quantized_init creates random tables; it cannot start from a checkpoint")
    if artifact == Artifact.SPLIT:
        split = split or SplitPlan()
    elif split is not None:
        raise ValueError(f"a split plan was given for a {artifact.value} artifact")
    stages = tqdm(total=6, desc="archive", unit="stage", file=sys.stderr)
    started = time.perf_counter()

    stages.set_postfix_str("spec")
    spec = ModelSpec.from_yaml(spec_path)
    name = name or spec.name
    if archive_format == "no-archive":
        _check_replaceable(model_store / name)  # before minutes of building, not after
    if artifact != Artifact.EAGER:
        check_capturable(spec)
    factory = DLRMFactory(spec)
    stages.update()

    if quantized_init:
        stages.set_postfix_str("random quantized tables")
        weights = factory.random_weights(seed)
        stages.update(2)
    else:
        stages.set_postfix_str("float model")
        reference = factory.float_model(seed=seed)
        if checkpoint is not None:
            factory.load_checkpoint(reference, DLRMFactory.read_checkpoint(checkpoint))
        stages.update()
        stages.set_postfix_str("quantize")
        weights = factory.quantize(reference)
        stages.update()

    with tempfile.TemporaryDirectory(prefix=f"{name}-archive-") as tmp:
        staging = Path(tmp) / "extra"
        shutil.copytree(HANDLERS_DIR, staging / "handlers", ignore=shutil.ignore_patterns("__pycache__"))
        spec.to_yaml(staging / "spec.yaml")
        factory.save_weights(weights, staging / "weights.pt")
        del weights  # a file-backed copy exists now; the reference model keeps what it needs
        if quantized_init:  # the tables as saved, mapped: their memory is page cache, not a copy
            reference = factory.inference_model(factory.load_weights(staging / "weights.pt"))
        weights_bytes = (staging / "weights.pt").stat().st_size
        config_path = Path(tmp) / "model-config.yaml"
        config_path.write_text(
            yaml.safe_dump(serving.model_config(artifact, weights_bytes, split), sort_keys=False)
        )
        reference_service = ScoringService(spec, reference)

        stages.set_postfix_str(f"capture ({artifact.value})")
        if artifact != Artifact.EAGER:
            capture(staging, artifact, split)
        stages.update()

        stages.set_postfix_str("verify")
        # The artifact as the handler loads it, against the model it was made from.
        served = ScoringService.from_dir(staging, artifact, _verifiable(split))
        data = (
            ValidationData.from_jsonl(validation)
            if validation is not None
            else ValidationData.generated(spec, reference_service, 64, 16, seed)
        )
        report = verify(served, reference_service, data, bounds)
        against = "built" if quantized_init else "float"
        for line in report.lines(against):
            tqdm.write(line, file=sys.stderr)
        model_store.mkdir(parents=True, exist_ok=True)
        (model_store / f"{name}.verification.json").write_bytes(report.to_json())
        (staging / "verification.json").write_bytes(report.to_json())  # kept inside the archive
        if not report.passed:
            stages.close()
            raise VerificationFailed(
                f"refusing to write {name}: " + "; ".join(report.failures)
                + f" (report: {model_store / f'{name}.verification.json'})"
            )
        stages.update()

        stages.set_postfix_str("torch-model-archiver")
        unzipped = archive_format == "no-archive"
        # unzipped: the model's files join the folder afterwards, renamed rather than copied (GBs)
        model_files = [f for f in staging.iterdir() if f.suffix in (".pt", ".pt2")]
        if unzipped:
            _clear_archive_folder(model_store / name)
            for file in model_files:
                file.rename(Path(tmp) / file.name)
        subprocess.run(
            [
                str(Path(sys.executable).parent / "torch-model-archiver"),
                "--model-name", name,
                "--version", version,
                "--handler", str(HANDLER_FILE),
                "--extra-files", str(staging),
                "--config-file", str(config_path),
                "--export-path", str(model_store),
                "--archive-format", archive_format,
                "--force",
            ],
            check=True,
        )
        archive = model_store / (name if unzipped else f"{name}.mar")
        if unzipped:
            for file in model_files:
                (Path(tmp) / file.name).replace(archive / file.name)
        stages.update()
    stages.close()
    size = sum(f.stat().st_size for f in archive.rglob("*")) if unzipped else archive.stat().st_size
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    tqdm.write(
        f"wrote {archive} ({size / 2**20:.1f} MiB, serving {artifact.value}; weights "
        f"{weights_bytes / 2**20:.1f} MiB) in {time.perf_counter() - started:.1f}s, "
        f"peak RSS {peak_gib:.2f} GiB",
        file=sys.stderr,
    )
    return archive


def _verifiable(split: SplitPlan | None) -> SplitPlan | None:
    """The plan to verify with: a dense part meant for a GPU is checked on the CPU where this
    machine has none (the same graph; only where its weights sit differs)."""
    if split is None or split.dense_device == "cpu" or torch.cuda.is_available():
        return split
    tqdm.write(f"no CUDA here: verifying the dense part on cpu, to be served on {split.dense_device}")
    return dataclasses.replace(split, dense_device="cpu")


def _check_replaceable(folder: Path) -> None:
    """Only an archive folder (with ``MAR-INF``) may be replaced by an unzipped build."""
    if folder.exists() and not (folder / "MAR-INF").is_dir():
        raise FileExistsError(f"{folder} exists and is not an archive folder; not replacing it")


def _clear_archive_folder(folder: Path) -> None:
    """An earlier unzipped archive of the same name is replaced whole: the archiver would keep its
    files, and a stale ``weights.pt`` of another artifact would ride along."""
    _check_replaceable(folder)
    if folder.exists():
        shutil.rmtree(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m archive_tools.build",
        description="Build a TorchServe .mar for a TorchRec DLRM: quantize, verify, package.",
    )
    parser.add_argument("--spec", type=Path, required=True, help="model spec YAML (config/models/)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", type=Path, help="trained float state dict (torch.save)")
    weights.add_argument("--seed", type=int, default=0, help="random weights from this seed (demo)")
    parser.add_argument(
        "--init",
        choices=("float", "quantized"),
        default="float",
        help="float: a float model (checkpoint or seed), quantized and verified against it; "
        "quantized: seeded random tables made in their served dtypes, never in float (huge models)",
    )
    parser.add_argument(
        "--artifact",
        choices=[a.value for a in Artifact],
        default=Artifact.EAGER.value,
        help="what the archive serves: aoti (AOTInductor package), exported (torch.export program), "
        "eager (TorchRec modules on memory-mapped weights) or split (a sparse and a dense part, "
        "see --sparse / --dense)",
    )
    defaults = SplitPlan()
    parser.add_argument(
        "--sparse",
        choices=[a.value for a in SPARSE_ARTIFACTS],
        help=f"split: the embedding lookups as (default {defaults.sparse.value}); eager keeps the "
        "tables in the memory-mapped weights.pt, for tables of many GB",
    )
    parser.add_argument(
        "--dense",
        choices=[a.value for a in DENSE_ARTIFACTS],
        help=f"split: the dense layers as (default {defaults.dense.value})",
    )
    parser.add_argument(
        "--dense-device",
        choices=DEVICES,
        help=f"split: where the dense part runs (default {defaults.dense_device}; cuda needs "
        "--dense exported)",
    )
    parser.add_argument(
        "--archive-format",
        choices=ARCHIVE_FORMATS,
        default="default",
        help="default: a zipped NAME.mar; no-archive: a folder NAME/ (no compression, no unpacking)",
    )
    parser.add_argument("--name", help="model name (default: the spec's name)")
    parser.add_argument("--version", default="1.0", help="model version (default: 1.0)")
    parser.add_argument("--model-store", type=Path, default=REPO_ROOT / "model_store")
    parser.add_argument("--batch-size", type=int, default=ServingConfig.batch_size)
    parser.add_argument("--max-batch-delay", type=int, default=ServingConfig.max_batch_delay_ms, help="ms")
    parser.add_argument("--workers", type=int, default=ServingConfig.workers)
    parser.add_argument("--intra-op-threads", type=int, default=ServingConfig.intra_op_threads)
    parser.add_argument(
        "--validation",
        type=Path,
        help="JSON-lines validation requests, optionally with labels (default: generated from the spec)",
    )
    parser.add_argument(
        "--max-score-diff",
        type=float,
        default=Bounds.max_abs_score_diff,
        help="refuse the archive if any validation score differs from the reference's by more",
    )
    parser.add_argument("--max-rel-score-diff", type=float, default=None, help="same, relative")
    parser.add_argument("--max-auc-drop", type=float, default=Bounds.max_auc_drop)
    parser.add_argument("--max-ne-increase", type=float, default=Bounds.max_ne_increase)
    args = parser.parse_args(argv)
    if args.init == "quantized" and args.checkpoint is not None:
        parser.error("--init quantized makes random tables; it does not read --checkpoint")
    artifact = Artifact(args.artifact)
    split_options = {"sparse": args.sparse, "dense": args.dense, "dense_device": args.dense_device}
    given = {k: v for k, v in split_options.items() if v is not None}
    if given and artifact != Artifact.SPLIT:
        parser.error(f"--{'/--'.join(given).replace('_', '-')}: only with --artifact split")
    try:
        split = SplitPlan.from_options(given) if artifact == Artifact.SPLIT else None
    except ValueError as e:
        parser.error(str(e))
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
        bounds=Bounds(
            max_abs_score_diff=args.max_score_diff,
            max_rel_score_diff=args.max_rel_score_diff,
            max_auc_drop=args.max_auc_drop,
            max_ne_increase=args.max_ne_increase,
        ),
        validation=args.validation,
        quantized_init=args.init == "quantized",
        archive_format=args.archive_format,
        artifact=artifact,
        split=split,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
