"""Build a TorchServe archive (``model_store/NAME.mar``) from a model spec and trained weights.

    torchrec-serve build --spec tiny --seed 0
    torchrec-serve build --spec config/models/criteo.yaml --checkpoint trained.pt
    torchrec-serve build --spec criteo_1tb --init quantized --archive-format no-archive --artifact aoti
    torchrec-serve build --spec criteo --artifact split --sparse eager --dense aoti

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

import handlers
from archive_tools.capture import capture, check_capturable
from archive_tools.precision import compare_dense_precisions, suggestion_lines
from archive_tools.summary import spec_summary
from archive_tools.validation_data import read_validation
from archive_tools.verification import Bounds, generated_validation, verify
from handlers.loading import load_service
from handlers.modeling.checkpoint import read_checkpoint
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema, load_spec
from handlers.modeling.spec import ModelSpec
from handlers.modeling.weights import InferenceWeights
from handlers.runtime.archive_files import (
    HANDLER,
    HANDLERS,
    INPUTS,
    MANIFEST,
    MODEL_CONFIG,
    SPEC,
    VERIFICATION,
    WEIGHTS,
)
from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InputError
from handlers.runtime.options import HandlerOptions
from handlers.runtime.remote.plan import RemotePlan
from handlers.runtime.split import SplitPlan

HANDLERS_DIR = Path(handlers.__file__).resolve().parent  # the package every archive carries
HANDLER_FILE = HANDLERS_DIR / HANDLER


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """TorchServe's per-model settings, written to the archive's ``model-config.yaml``."""

    batch_size: int = 32
    max_batch_delay_ms: int = 5
    workers: int = 1
    # Served on 2 cores beside TorchServe's frontend, a second thread pays from about 400 items
    # per forward (`python -m benchmarks.threads`); smaller forwards run on one.
    intra_op_threads: int = 2
    parallel_from_items: int = 400
    # TorchServe's own reply timeout, a backstop: the plugin's watchdog restarts a hung worker first.
    response_timeout_s: int = 30
    metrics_flush_s: float = 1.0
    # The plugin's admission control and watchdog (0: derived from the measured batch time).
    max_queue_wait_ms: int = 0
    hang_after_ms: int = 0
    # How fast a published delta's rows are written into the served tables (handlers.runtime.freshness).
    delta_rows_per_s: float = 80_000.0

    def model_config(
        self, artifact: Artifact, weights_bytes: int, split: SplitPlan | None, remote: RemotePlan | None = None
    ) -> dict:
        # Loading is dominated by reading the weights: allow a minute plus 30 s per GB.
        startup_timeout_s = 60 + int(30 * weights_bytes / 2**30)
        return {
            "minWorkers": self.workers,
            "maxWorkers": self.workers,
            "batchSize": self.batch_size,
            "maxBatchDelay": self.max_batch_delay_ms,
            "responseTimeout": self.response_timeout_s,
            "startupTimeout": startup_timeout_s,
            "handler": HandlerOptions(
                artifact, split, self.intra_op_threads, self.parallel_from_items, self.metrics_flush_s, remote
            ).to_mapping(),
            "guard": {"max_queue_wait_ms": self.max_queue_wait_ms, "hang_after_ms": self.hang_after_ms},
            "freshness": {"rows_per_s": self.delta_rows_per_s},
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
    compare_precisions: bool = False,
) -> Path:
    """Runs every stage and returns the path of the written ``.mar`` (or folder, for
    ``no-archive``); raises if verification fails. ``split``: the parts of a ``split`` artifact;
    ``compare_precisions``: also time and check every dense precision, and suggest one."""
    if quantized_init and checkpoint is not None:
        raise InputError("quantized_init creates random tables; it cannot start from a checkpoint")
    if artifact == Artifact.SPLIT:
        split = split or SplitPlan()
    elif split is not None:
        raise InputError(f"a split plan was given for a {artifact.value} artifact")
    started = time.perf_counter()
    with tqdm(total=6, desc="archive", unit="stage", file=sys.stderr) as stages:
        stages.set_postfix_str("spec")
        spec = load_spec(spec_path)
        name = name or spec.name
        if archive_format == "no-archive":
            check_replaceable(model_store / name)  # before minutes of building, not after
        if artifact != Artifact.EAGER:
            check_capturable(spec)
        factory = DLRMFactory(spec)
        for line in spec_summary(spec, factory):
            tqdm.write(line, file=sys.stderr)
        stages.update()

        weights, reference = served_weights(factory, checkpoint, seed, quantized_init, stages)

        with tempfile.TemporaryDirectory(prefix=f"{name}-archive-") as tmp:
            staging = Path(tmp) / "extra"
            stage_files(staging, spec, factory, weights)
            del weights  # a file-backed copy exists now; the reference model keeps what it needs
            if reference is None:  # the tables as saved, mapped: page cache, not a copy
                reference = factory.inference_model(factory.load_weights(staging / WEIGHTS))
            weights_bytes = (staging / WEIGHTS).stat().st_size
            config_path = Path(tmp) / MODEL_CONFIG
            config = serving.model_config(artifact, weights_bytes, split)
            config_path.write_text(yaml.safe_dump(config, sort_keys=False))

            reference_service = eager_service(spec, reference)
            data = (
                read_validation(validation, spec)
                if validation is not None
                else generated_validation(spec, reference_service, 64, 16, seed)
            )
            if compare_precisions:
                stages.set_postfix_str("dense precisions")
                tables = factory.load_weights(staging / WEIGHTS)
                rows = compare_dense_precisions(spec, tables, reference_service, data, bounds)
                for line in suggestion_lines(rows):
                    tqdm.write(line, file=sys.stderr)

            stages.set_postfix_str(f"capture ({artifact.value})")
            if artifact != Artifact.EAGER:
                capture(staging, artifact, split)
            stages.update()

            stages.set_postfix_str("verify")
            # The artifact as the handler loads it, against the model it was made from.
            served = load_service(staging, HandlerOptions(artifact, _verifiable(split)))
            report = verify(served, reference_service, data, bounds)
            for line in report.lines("built" if quantized_init else "float"):
                tqdm.write(line, file=sys.stderr)
            report_path = model_store / f"{name}.{VERIFICATION}"
            model_store.mkdir(parents=True, exist_ok=True)
            report_path.write_bytes(report.to_json())
            (staging / VERIFICATION).write_bytes(report.to_json())  # kept inside the archive
            if not report.passed:
                raise VerificationFailed(
                    f"refusing to write {name}: {'; '.join(report.failures)} (report: {report_path})"
                )
            stages.update()

            stages.set_postfix_str("torch-model-archiver")
            archive = package_archive(staging, config_path, name, version, model_store, archive_format)
            stages.update()
    size = sum(f.stat().st_size for f in archive.rglob("*")) if archive.is_dir() else archive.stat().st_size
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    tqdm.write(
        f"wrote {archive} ({size / 2**20:.1f} MiB, serving {artifact.value}; weights "
        f"{weights_bytes / 2**20:.1f} MiB) in {time.perf_counter() - started:.1f}s, "
        f"peak RSS {peak_gib:.2f} GiB",
        file=sys.stderr,
    )
    return archive


def served_weights(
    factory: DLRMFactory, checkpoint: Path | None, seed: int, quantized_init: bool, stages: tqdm
) -> tuple[InferenceWeights, torch.nn.Module | None]:
    """The served tables and dense weights, and the float model they came from (None for
    ``quantized_init``: seeded random tables made in their served dtypes). Two stages."""
    if quantized_init:
        stages.set_postfix_str("random quantized tables")
        weights = factory.random_weights(seed)
        stages.update(2)
        return weights, None
    stages.set_postfix_str("float model")
    reference = factory.float_model(seed=seed)
    if checkpoint is not None:
        note = factory.load_checkpoint(reference, read_checkpoint(checkpoint))
        if note:
            tqdm.write(f"checkpoint {checkpoint}: {note}", file=sys.stderr)
    stages.update()
    stages.set_postfix_str("quantize")
    weights = factory.quantize(reference)
    stages.update()
    return weights, reference


def stage_files(staging: Path, spec: ModelSpec, factory: DLRMFactory, weights: InferenceWeights) -> None:
    """The archive's extra files: the handlers package, the spec, its inputs, the weights."""
    shutil.copytree(HANDLERS_DIR, staging / HANDLERS, ignore=shutil.ignore_patterns("__pycache__"))
    spec.to_yaml(staging / SPEC)
    input_schema(spec).save(staging / INPUTS)
    factory.save_weights(weights, staging / WEIGHTS)
    factory.tables_layout(staging / WEIGHTS).save(staging)  # where deltas write, and the base


def package_archive(
    staging: Path, config_path: Path, name: str, version: str, model_store: Path, archive_format: str
) -> Path:
    """``torch-model-archiver`` over the staged files: ``NAME.mar``, or the folder ``NAME/``."""
    unzipped = archive_format == "no-archive"
    # unzipped: the model's files join the folder afterwards, renamed rather than copied (GBs)
    model_files = [f for f in staging.iterdir() if f.suffix in (".pt", ".pt2")]
    if unzipped:
        _clear_archive_folder(model_store / name)
        for file in model_files:
            file.rename(staging.parent / file.name)
    subprocess.run(
        [
            # the torch-model-archiver command, run by this interpreter wherever it is installed
            sys.executable, "-c", "from model_archiver.model_packaging import generate_model_archive as "
            "main; main()",
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
            (staging.parent / file.name).replace(archive / file.name)
    return archive


def _verifiable(split: SplitPlan | None) -> SplitPlan | None:
    """The plan to verify with: a dense part meant for a GPU is checked on the CPU where this
    machine has none (the same graph; only where its weights sit differs)."""
    if split is None or split.dense_device == "cpu" or torch.cuda.is_available():
        return split
    tqdm.write(f"no CUDA here: verifying the dense part on cpu, to be served on {split.dense_device}")
    return dataclasses.replace(split, dense_device="cpu")


def check_replaceable(folder: Path) -> None:
    """Only an archive folder (with ``MAR-INF``) may be replaced by an unzipped build."""
    if folder.exists() and not (folder / MANIFEST).is_file():
        raise FileExistsError(f"{folder} exists and is not an archive folder; not replacing it")


def _clear_archive_folder(folder: Path) -> None:
    """An earlier unzipped archive of the same name is replaced whole: the archiver would keep its
    files, and a stale ``weights.pt`` of another artifact would ride along."""
    check_replaceable(folder)
    if folder.exists():
        shutil.rmtree(folder)
