"""Build a TorchServe archive (``model_store/NAME.mar``) from a model spec and trained weights.

    torchrec-serve build --spec tiny --seed 0
    torchrec-serve build --spec config/models/criteo.yaml --checkpoint trained.pt
    torchrec-serve build --spec criteo_1tb --init quantized --archive-format no-archive --artifact aoti
    torchrec-serve build --spec criteo --artifact split --sparse eager --dense aoti

The stages (``archive_tools.pipeline``): spec -> float model (checkpoint, or seeded random weights
for demos) -> per-table quantization (FBGEMM TBE) -> capture (``--artifact``: the whole model, or
its sparse and dense parts, as exported programs or AOTInductor packages; ``archive_tools.capture``)
-> reload exactly as the handler will and compare its scores with the float model's -> package
handler, ``handlers`` package, spec, the artifact's files and ``model-config.yaml`` with
``torch-model-archiver``.

``--init quantized`` skips the float model: seeded random tables are created straight in their
served dtypes (for models too large to hold in float), and verification checks that the reloaded
artifact scores exactly as the model that was built (run on its saved, memory-mapped weights).
``--archive-format no-archive`` writes a folder instead of a zipped ``.mar``: nothing to compress at
build or unpack at register, for models of many GB.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from archive_tools.capture import capture, check_capturable
from archive_tools.model_config import ServingConfig
from archive_tools.pipeline import (
    archive_bytes,
    check_replaceable,
    package,
    reference_service,
    served_weights,
    stage_files,
    validation_data,
    verify_staged,
)
from archive_tools.precision import compare_dense_precisions, suggestion_lines
from archive_tools.progress import StageBar
from archive_tools.summary import spec_summary
from archive_tools.verification import Bounds
from handlers.loading import load_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.modeling.spec import ModelSpec
from handlers.runtime.archive_files import WEIGHTS
from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InputError
from handlers.runtime.options import HandlerOptions
from handlers.runtime.slot_maps import owners_of
from handlers.runtime.split import SplitPlan


def build_archive(
    spec_path: Path, *, checkpoint: Path | None, seed: int, name: str | None, version: str, model_store: Path,
    serving: ServingConfig, bounds: Bounds = Bounds(), validation: Path | None = None, quantized_init: bool = False,
    archive_format: str = "default", artifact: Artifact = Artifact.EAGER, split: SplitPlan | None = None,
    compare_precisions: bool = False,
) -> Path:
    """Runs every stage and returns the path of the written ``.mar`` (or folder, for
    ``no-archive``); raises ``VerificationFailed`` past the bounds. ``split``: the parts of a
    ``split`` artifact; ``compare_precisions``: also time and check every dense precision, and
    suggest one."""
    split = _checked_split(artifact, split, quantized_init and checkpoint is not None)
    started = time.perf_counter()
    with StageBar(6, "archive") as stages:
        stages.set_postfix_str("spec")
        spec = load_spec(spec_path)
        name = name or spec.name
        _check_before_building(spec, model_store / name, archive_format, artifact)
        factory = DLRMFactory(spec)
        _print(spec_summary(spec, factory))
        stages.update()

        weights, float_model = served_weights(factory, checkpoint, seed, quantized_init, stages)

        with tempfile.TemporaryDirectory(prefix=f"{name}-archive-") as tmp:
            staging = Path(tmp) / "extra"
            stage_files(staging, spec, factory, weights, carry_code=_runs_modules(artifact, split))
            owned_ids = {t: owners_of(m) for t, m in weights.slot_maps.items()}  # what generated validation draws
            del weights  # a file-backed copy exists now; the reference model keeps what it needs
            weights_bytes = (staging / WEIGHTS).stat().st_size
            reference = reference_service(spec, factory, float_model, staging)
            data = validation_data(spec, reference, validation, seed, owned_ids)
            if compare_precisions:
                stages.set_postfix_str("dense precisions")
                _print(suggestion_lines(compare_dense_precisions(spec, factory.load_weights(staging / WEIGHTS),
                                                                 reference, data, bounds)))

            stages.set_postfix_str(f"capture ({artifact.value})")
            if artifact != Artifact.EAGER:
                capture(staging, artifact, split)
            stages.update()

            stages.set_postfix_str("verify")
            verify_staged(load_service(staging, HandlerOptions(artifact, _verifiable(split))), reference, data, bounds,
                          name=name, model_store=model_store, staging=staging, against="built" if quantized_init else "float")
            stages.update()

            stages.set_postfix_str("torch-model-archiver")
            archive = package(staging, serving.model_config(artifact, weights_bytes, split), name, version, model_store,
                              archive_format)
            stages.update()
    _report_written(archive, artifact, weights_bytes, started)
    return archive


def _check_before_building(spec: ModelSpec, archive: Path, archive_format: str, artifact: Artifact) -> None:
    """What would fail at the end, refused before minutes of building."""
    if archive_format == "no-archive":
        check_replaceable(archive)
    if artifact != Artifact.EAGER:
        check_capturable(spec, split=artifact == Artifact.SPLIT)


def _checked_split(artifact: Artifact, split: SplitPlan | None, quantized_from_checkpoint: bool) -> SplitPlan | None:
    """The split plan the build uses (the default one for a split artifact); refuses arguments
    that contradict each other."""
    if quantized_from_checkpoint:
        raise InputError("quantized_init creates random tables; it cannot start from a checkpoint")
    if artifact == Artifact.SPLIT:
        return split or SplitPlan()
    if split is not None:
        raise InputError(f"a split plan was given for a {artifact.value} artifact")
    return None


def _report_written(archive: Path, artifact: Artifact, weights_bytes: int, started: float) -> None:
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    tqdm.write(
        f"wrote {archive} ({archive_bytes(archive) / 2**20:.1f} MiB, serving {artifact.value}; weights "
        f"{weights_bytes / 2**20:.1f} MiB) in {time.perf_counter() - started:.1f}s, "
        f"peak RSS {peak_gib:.2f} GiB",
        file=sys.stderr,
    )


def _print(lines: list[str]) -> None:
    for line in lines:
        tqdm.write(line, file=sys.stderr)


def _runs_modules(artifact: Artifact, split: SplitPlan | None) -> bool:
    """Whether the archive's workers run TorchRec modules (and so import the architecture)."""
    return artifact == Artifact.EAGER or (split is not None and split.sparse == Artifact.EAGER)


def _verifiable(split: SplitPlan | None) -> SplitPlan | None:
    """The plan to verify with: a dense part meant for a GPU is checked on the CPU where this
    machine has none (the same graph; only where its weights sit differs)."""
    if split is None or split.dense_device == "cpu" or torch.cuda.is_available():
        return split
    tqdm.write(f"no CUDA here: verifying the dense part on cpu, to be served on {split.dense_device}")
    return dataclasses.replace(split, dense_device="cpu")
