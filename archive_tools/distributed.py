"""Build a distributed layout's archives from one spec and one checkpoint: one embedding shard
archive per group of tables (the spec's ``tables[].shard`` keys) and one dense archive that calls
them (``handlers.runtime.remote``); and split a delta of changed rows into one per shard.

    torchrec-serve build --spec criteo_1tb --artifact distributed --dense aoti --init quantized
    # model_store/criteo_1tb-a.mar, criteo_1tb-b.mar: lookups only (ids in, pooled embeddings out)
    # model_store/criteo_1tb-dense.mar: the dense part, calling the shards over gRPC
    torchrec-serve delta model_store/criteo_1tb-dense.mar --rows touched.pt --sequence 1
    # model_store/deltas/criteo_1tb-a-00000001.delta, ...-b-00000001.delta: each shard's tables

The served weights are made once, as for a single-host build; each shard gets its tables' rows
byte for byte. Before anything is written the layout is verified as it will serve: each shard
loaded as its worker loads it, called in process through the same v2 bytes a remote call
carries, the dense part loaded from its archive files, against the single-host model.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from archive_tools.build import (
    HANDLERS_DIR,
    ServingConfig,
    VerificationFailed,
    check_replaceable,
    package_archive,
    served_weights,
    stage_files,
)
from archive_tools.capture import capture, check_capturable
from archive_tools.delta import DeltaSource, DeltaSummary, make_delta
from archive_tools.validation_data import read_validation
from archive_tools.verification import Bounds, generated_validation, verify
from handlers.loading import dense_host_model, load_service
from handlers.modeling.eager import EagerModel, eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema, load_spec, synthetic_request
from handlers.modeling.spec import ModelSpec
from handlers.modeling.weights import InferenceWeights
from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import (
    HANDLERS,
    INPUTS,
    MODEL_CONFIG,
    SPEC,
    TABLES,
    VERIFICATION,
    WEIGHTS,
)
from handlers.runtime.artifacts import Artifact
from handlers.runtime.batching import coalesce
from handlers.runtime.errors import InputError
from handlers.runtime.inputs import InputSchema, Limits, Output
from handlers.runtime.options import HandlerOptions
from handlers.runtime.remote.lookups import InProcessShard
from handlers.runtime.remote.plan import RemotePlan, ShardRoute
from handlers.runtime.service import ScoringService
from handlers.runtime.split import SplitPlan
from handlers.runtime.wire.decoder import RequestDecoder

DENSE_SUFFIX = "dense"
# A shard takes a dense host's whole forward in one request: up to TorchServe's request size limit
# (max_request_size in config/config.properties).
SHARD_MAX_REQUEST_BYTES = 32 << 20


def shard_model_name(name: str, shard: str) -> str:
    """The archive and model name of one shard of the model ``name``."""
    return f"{name}-{shard}"


def build_distributed(
    spec_path: Path,
    *,
    checkpoint: Path | None,
    seed: int,
    name: str | None,
    version: str,
    model_store: Path,
    serving: ServingConfig,
    dense: Artifact = Artifact.AOTI,
    bounds: Bounds = Bounds(),
    validation: Path | None = None,
    quantized_init: bool = False,
    archive_format: str = "default",
) -> list[Path]:
    """Writes ``NAME-<shard>`` per shard and ``NAME-dense``; returns their paths (dense last).
    Raises ``VerificationFailed`` (nothing written) when the layout does not score like the model."""
    started = time.perf_counter()
    spec = load_spec(spec_path)
    name = name or spec.name
    if not spec.shards:
        raise InputError(
            f"{spec_path}: tables[].shard: no table names its shard; give each table one to build "
            "a distributed layout"
        )
    check_capturable(spec)
    names = [shard_model_name(name, s) for s in spec.shards] + [shard_model_name(name, DENSE_SUFFIX)]
    if archive_format == "no-archive":
        for archive_name in names:
            check_replaceable(model_store / archive_name)
    factory = DLRMFactory(spec)
    with tqdm(total=6, desc="distributed archives", unit="stage", file=sys.stderr) as stages:
        weights, reference = served_weights(factory, checkpoint, seed, quantized_init, stages)
        with tempfile.TemporaryDirectory(prefix=f"{name}-distributed-") as tmp:
            whole = Path(tmp) / DENSE_SUFFIX / "extra"  # the single-host staging; the dense part comes from it
            stage_files(whole, spec, factory, weights)
            del weights
            tables = factory.load_weights(whole / WEIGHTS)  # mapped: page cache, no copy
            if reference is None:
                reference = factory.inference_model(tables)
            reference_service = eager_service(spec, reference)
            data = (
                read_validation(validation, spec)
                if validation is not None
                else generated_validation(spec, reference_service, 64, 16, seed)
            )

            stages.set_postfix_str("shards")
            routes, shard_dirs = [], []
            for shard in spec.shards:
                shard_spec = spec.shard_spec(shard)
                folder = Path(tmp) / shard / "extra"
                stage_shard(folder, shard_spec, tables.tables, spec.limits.to_limits())
                routes.append(
                    ShardRoute(shard, shard_model_name(name, shard), shard_spec.feature_names, shard_spec.feature_dims)
                )
                shard_dirs.append(folder)
            plan = RemotePlan(dense, tuple(routes), stacked=_stacked(spec, factory, tables))
            del tables
            stages.update()

            stages.set_postfix_str(f"capture the dense part ({dense.value})")
            capture(whole, Artifact.SPLIT, SplitPlan(sparse=Artifact.EAGER, dense=dense))
            for leftover in (WEIGHTS, TABLES):  # the tables live on the shards
                (whole / leftover).unlink(missing_ok=True)
            stages.update()

            stages.set_postfix_str("verify")
            shards = [
                InProcessShard(route, load_service(folder, HandlerOptions(Artifact.LOOKUPS)))
                for route, folder in zip(routes, shard_dirs)
            ]
            schema = InputSchema.from_file(whole / INPUTS)
            served = ScoringService(schema, dense_host_model(whole, schema, plan, shards))
            report = verify(served, reference_service, data, bounds)
            for line in report.lines("built" if quantized_init else "float"):
                tqdm.write(line, file=sys.stderr)
            model_store.mkdir(parents=True, exist_ok=True)
            report_path = model_store / f"{names[-1]}.{VERIFICATION}"
            report_path.write_bytes(report.to_json())
            (whole / VERIFICATION).write_bytes(report.to_json())
            if not report.passed:
                raise VerificationFailed(
                    f"refusing to write the layout of {name}: {'; '.join(report.failures)} (report: {report_path})"
                )
            del shards, served
            stages.update()

            stages.set_postfix_str("torch-model-archiver")
            archives = []
            # A shard call is a dense host's whole batch already: answered as it comes, not held
            # for others (TorchServe waits maxBatchDelay for a batch to fill; 0 means its default).
            shard_serving = dataclasses.replace(serving, batch_size=1, max_batch_delay_ms=1)
            for route, folder in zip(routes, shard_dirs):
                config = shard_serving.model_config(Artifact.LOOKUPS, (folder / WEIGHTS).stat().st_size, None)
                archives.append(_package_with(folder, config, route.model, version, model_store, archive_format))
            dense_bytes = sum(f.stat().st_size for f in whole.glob("*.pt*"))
            # A dense host's batch may wait out a shard's fail-over: admission control, which
            # sheds requests that would queue longer than a few batch times, allows for it.
            wait_ms = serving.max_queue_wait_ms or int(2 * plan.deadline.max_ms)
            dense_serving = dataclasses.replace(serving, max_queue_wait_ms=wait_ms)
            config = dense_serving.model_config(Artifact.REMOTE, dense_bytes, None, plan)
            archives.append(_package_with(whole, config, names[-1], version, model_store, archive_format))
            stages.update()
    for archive in archives:
        size = sum(f.stat().st_size for f in archive.rglob("*")) if archive.is_dir() else archive.stat().st_size
        tqdm.write(f"wrote {archive} ({size / 2**20:.1f} MiB)", file=sys.stderr)
    tqdm.write(f"built {len(archives)} archives in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return archives


def split_delta(dense_archive: Path, rows: Path, sequence: int) -> list[DeltaSummary]:
    """Changed rows of a layout's tables (a rows file, as ``delta --rows`` takes) -> one delta per
    shard, of the tables it owns, made against its archive (beside the dense one in the model
    store) and written to the store's ``deltas/`` as ``<shard model>-<sequence>.delta``, where its
    hosts' plugin finds it. A shard whose tables did not change gets a delta of no rows, so every
    shard's log keeps the layout's sequence numbers. A table no shard holds is refused."""
    store = Path(dense_archive).parent
    with tempfile.TemporaryDirectory(prefix="layout-delta-") as tmp:
        with Archive.open(dense_archive) as archive:
            options = archive.options
        if options.remote is None:
            raise InputError(f"{dense_archive}: not a dense archive of a distributed layout ({options.describe()})")
        given = torch.load(rows, map_location="cpu", weights_only=True)
        shard_of = {}
        for route in options.remote.shards:
            with Archive.open(_archive_in(store, route.model)) as shard:
                shard_of.update({t.name: route for t in load_spec(shard.file(SPEC)).tables})
        unknown = sorted(set(given) - set(shard_of))
        if unknown:
            raise InputError(f"{rows}: tables {unknown} are on no shard of the layout; it has {sorted(shard_of)}")
        written = []
        for route in options.remote.shards:
            part = Path(tmp) / f"{route.name}.rows.pt"
            torch.save({t: change for t, change in given.items() if shard_of[t] is route}, part)
            out = store / "deltas" / f"{route.model}-{sequence:08d}.delta"
            out.parent.mkdir(parents=True, exist_ok=True)
            written.append(make_delta(_archive_in(store, route.model), DeltaSource(rows=part), out, sequence, route.model))
        return written


def _archive_in(store: Path, model: str) -> Path:
    """A model's archive in the store: its folder, or its ``.mar``."""
    folder = store / model
    return folder if folder.is_dir() else store / f"{model}.mar"


def shard_schema(shard_spec: ModelSpec, model_limits: Limits) -> InputSchema:
    """What a shard takes: the ids of its features for a dense host's whole forward."""
    model = input_schema(shard_spec)
    limits = Limits(
        max_request_bytes=SHARD_MAX_REQUEST_BYTES,
        max_items_per_request=model_limits.max_items_per_forward,
        max_ids_per_bag=model_limits.max_ids_per_bag,
        max_items_per_forward=model_limits.max_items_per_forward,
    )
    return InputSchema(
        model=shard_spec.name,
        tags=(model.jagged,),
        dense_features=0,
        features=model.features,
        weighted_ids=model.weighted_ids,
        out_of_range=model.out_of_range,
        limits=limits,
        output=Output.EMBEDDINGS,
        embedding_widths=tuple(shard_spec.feature_dims),
    )


def stage_shard(folder: Path, shard_spec: ModelSpec, rows: dict, model_limits: Limits) -> None:
    """A shard archive's files: the handlers package, its spec and inputs, its tables' rows."""
    shutil.copytree(HANDLERS_DIR, folder / HANDLERS, ignore=shutil.ignore_patterns("__pycache__"))
    shard_spec.to_yaml(folder / SPEC)
    shard_schema(shard_spec, model_limits).save(folder / INPUTS)
    factory = DLRMFactory(shard_spec)
    weights = InferenceWeights({t.name: rows[t.name] for t in shard_spec.tables}, {}, None)
    factory.save_weights(weights, folder / WEIGHTS)
    factory.tables_layout(folder / WEIGHTS).save(folder)


def _stacked(spec: ModelSpec, factory: DLRMFactory, tables: InferenceWeights) -> bool:
    """Whether the architecture's dense part takes [N, F, D] (else [N, sum of widths])."""
    schema = input_schema(spec)
    decoder = RequestDecoder(schema)
    batch = coalesce([decoder.decode(synthetic_request(spec, 2, seed=0)).inputs], schema.tags)
    lookups = factory.lookups(InferenceWeights(tables.tables, {}, tables.buffers))
    with torch.inference_mode():
        return EagerModel(lookups, (schema.jagged,))(batch).dim() == 3


def _package_with(
    staging: Path, config: dict, name: str, version: str, model_store: Path, archive_format: str
) -> Path:
    config_path = staging.parent / MODEL_CONFIG
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return package_archive(staging, config_path, name, version, model_store, archive_format)
