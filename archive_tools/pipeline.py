"""The stages of an archive build, each a function that can be run and tested alone. The single-host
build (``archive_tools.build``) runs them in order; the distributed build
(``archive_tools.distributed``) runs the same ones and adds only its split into shards and their
packaging.

    weights     served_weights: float model (+ checkpoint) quantized per table, or seeded random
                tables made in their served dtypes (``--init quantized``)
    stage       stage_files: the archive's files in a folder (handlers package, spec, inputs,
                weights, table layout)
    reference   reference_service: the model verification compares against
    data        validation_data: the user's labelled file, or requests generated from the spec
    capture     archive_tools.capture: the artifact's graphs
    verify      verify_staged: the staged files loaded as a worker loads them, against the
                reference; the report is written, and nothing is packaged past the bounds
    package     package: model-config.yaml and torch-model-archiver over the staged files
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping

import torch
import yaml
from tqdm import tqdm

import handlers
from archive_tools.validation_data import ValidationData, read_validation
from archive_tools.verification import Bounds, VerificationReport, generated_validation, verify
from handlers.modeling.archive_code import ArchitectureRecord
from handlers.modeling.checkpoint import read_checkpoint
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema
from handlers.modeling.spec import ModelSpec
from handlers.modeling.weights import InferenceWeights
from handlers.runtime.archive_files import (
    HANDLER, HANDLERS, INPUTS, MANIFEST, MODEL_CONFIG, PRUNING, SPEC, VERIFICATION, WEIGHTS,
)
from handlers.runtime.inputs import InputSchema
from handlers.runtime.service import ScoringService

HANDLERS_DIR = Path(handlers.__file__).resolve().parent  # the package every archive carries
HANDLER_FILE = HANDLERS_DIR / HANDLER
ARCHIVE_FORMATS = ("default", "no-archive")
GENERATED_REQUESTS, GENERATED_ITEMS = 64, 16  # validation data made from the spec


class VerificationFailed(RuntimeError):
    """The served artifact does not predict like the model it was made from; nothing was written."""


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


def stage_files(
    staging: Path,
    spec: ModelSpec,
    factory: DLRMFactory,
    weights: InferenceWeights,
    inputs: InputSchema | None = None,
    carry_code: bool = True,
) -> None:
    """The archive's extra files: the handlers package, the spec (and a pruned model's kept ids), its
    architecture's record (and, with ``carry_code``, a user's architecture package: its workers run
    TorchRec modules), its inputs (``inputs``, or the spec's model's), the weights and where each
    table's rows lie in them."""
    shutil.copytree(HANDLERS_DIR, staging / HANDLERS, ignore=shutil.ignore_patterns("__pycache__"))
    if spec.pruning is not None:  # the archive carries its pruned tables' kept ids
        torch.save(factory.kept, staging / PRUNING)
        spec = spec.replace(pruning=PRUNING)
    spec.to_yaml(staging / SPEC)
    said = ArchitectureRecord.of(spec).stage(staging, carry_code)
    if said:
        tqdm.write(said, file=sys.stderr)
    (inputs or input_schema(spec)).save(staging / INPUTS)
    factory.save_weights(weights, staging / WEIGHTS)
    factory.tables_layout(staging / WEIGHTS).save(staging)  # where deltas write, and the base


def reference_service(
    spec: ModelSpec, factory: DLRMFactory, float_model: torch.nn.Module | None, staging: Path
) -> ScoringService:
    """What the built archive is checked against: the float model, or for ``--init quantized``
    the model that was built, run on its staged weights (mapped: page cache, not a copy)."""
    model = float_model if float_model is not None else factory.inference_model(factory.load_weights(staging / WEIGHTS))
    return eager_service(spec, model)


def validation_data(
    spec: ModelSpec, reference: ScoringService, path: Path | None, seed: int,
    owned_ids: Mapping[str, torch.Tensor] | None = None,
) -> ValidationData:
    """The user's validation file, or requests generated from the spec (raw ids mostly among the
    ``owned_ids``, per table) and labelled from the reference's own scores."""
    if path is not None:
        return read_validation(path, spec)
    return generated_validation(spec, reference, GENERATED_REQUESTS, GENERATED_ITEMS, seed, owned_ids)


def verify_staged(
    served: ScoringService,
    reference: ScoringService,
    data: ValidationData,
    bounds: Bounds,
    *,
    name: str,
    model_store: Path,
    staging: Path,
    against: str,
) -> VerificationReport:
    """Verifies and writes the report (``model_store/NAME.verification.json``, and into the
    archive); raises ``VerificationFailed`` past the bounds. ``against``: what the reference is,
    for the report's lines (``float``, or ``built``)."""
    report = verify(served, reference, data, bounds)
    for line in report.lines(against):
        tqdm.write(line, file=sys.stderr)
    model_store.mkdir(parents=True, exist_ok=True)
    report_path = model_store / f"{name}.{VERIFICATION}"
    report_path.write_bytes(report.to_json())
    (staging / VERIFICATION).write_bytes(report.to_json())  # kept inside the archive
    if not report.passed:
        raise VerificationFailed(f"refusing to write {name}: {'; '.join(report.failures)} (report: {report_path})")
    return report


def package(
    staging: Path, model_config: dict, name: str, version: str, model_store: Path, archive_format: str
) -> Path:
    """``torch-model-archiver`` over the staged files, with ``model_config`` as the archive's
    ``model-config.yaml``: ``NAME.mar``, or the folder ``NAME/``."""
    model_store.mkdir(parents=True, exist_ok=True)
    config_path = staging.parent / MODEL_CONFIG
    config_path.write_text(yaml.safe_dump(model_config, sort_keys=False))
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
        # the archiver copies the files into <temp dir>/<model name>: two builds of one name at
        # once (parallel tests, two users) would share and delete each other's
        env={**os.environ, "TMPDIR": str(staging.parent)},
    )
    archive = model_store / (name if unzipped else f"{name}.mar")
    if unzipped:
        for file in model_files:
            (staging.parent / file.name).replace(archive / file.name)
    return archive


def archive_bytes(archive: Path) -> int:
    return sum(f.stat().st_size for f in archive.rglob("*")) if archive.is_dir() else archive.stat().st_size


def check_replaceable(folder: Path) -> None:
    """Only an archive folder (with a manifest) may be replaced by an unzipped build."""
    if folder.exists() and not (folder / MANIFEST).is_file():
        raise FileExistsError(f"{folder} exists and is not an archive folder; not replacing it")


def _clear_archive_folder(folder: Path) -> None:
    """An earlier unzipped archive of the same name is replaced whole: the archiver would keep its
    files, and a stale ``weights.pt`` of another artifact would ride along."""
    check_replaceable(folder)
    if folder.exists():
        shutil.rmtree(folder)
