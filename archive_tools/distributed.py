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
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from archive_tools.capture import capture, check_capturable
from archive_tools.delta import DeltaSource, DeltaSummary, make_delta, read_rows_file
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
from archive_tools.progress import StageBar
from archive_tools.verification import Bounds
from handlers.loading import dense_host_model, load_service
from handlers.modeling.eager import EagerModel
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import archive_spec, input_schema, load_spec, synthetic_request
from handlers.modeling.spec import ModelSpec
from handlers.modeling.weights import InferenceWeights, TableRows
from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import INPUTS, TABLES, WEIGHTS
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
    Raises ``VerificationFailed`` (nothing written) when the layout does not score like the model.
    The stages are the single-host build's (``archive_tools.pipeline``), with the tables split
    into shards after staging, and one archive packaged per shard."""
    started = time.perf_counter()
    spec = load_spec(spec_path)
    name = name or spec.name
    dense_name = shard_model_name(name, DENSE_SUFFIX)
    _check_before_building(spec, spec_path, [shard_model_name(name, s) for s in spec.shards] + [dense_name],
                           model_store, archive_format)
    factory = DLRMFactory(spec)
    with StageBar(6, "distributed archives") as stages:
        weights, float_model = served_weights(factory, checkpoint, seed, quantized_init, stages)
        with tempfile.TemporaryDirectory(prefix=f"{name}-distributed-") as tmp:
            whole = Path(tmp) / DENSE_SUFFIX / "extra"  # the single-host staging; the dense part comes from it
            stage_files(whole, spec, factory, weights, carry_code=False)  # the dense host runs graphs only
            del weights
            reference = reference_service(spec, factory, float_model, whole)
            data = validation_data(spec, reference, validation, seed)

            stages.set_postfix_str("shards")
            tables = factory.load_weights(whole / WEIGHTS)  # mapped: page cache, no copy
            shards = _stage_shards(Path(tmp), spec, tables, name)
            plan = RemotePlan(dense, tuple(route for route, _ in shards), stacked=_stacked(spec, factory, tables))
            del tables  # capture replaces the file they are mapped from
            stages.update()

            stages.set_postfix_str(f"capture the dense part ({dense.value})")
            capture(whole, Artifact.SPLIT, SplitPlan(sparse=Artifact.EAGER, dense=dense))
            for leftover in (WEIGHTS, TABLES):  # the tables live on the shards
                (whole / leftover).unlink(missing_ok=True)
            stages.update()

            stages.set_postfix_str("verify")
            verify_staged(_layout_service(whole, plan, shards), reference, data, bounds, name=dense_name,
                          model_store=model_store, staging=whole, against="built" if quantized_init else "float")
            stages.update()

            stages.set_postfix_str("torch-model-archiver")
            archives = _package_layout(whole, shards, plan, serving, dense_name, version, model_store, archive_format)
            stages.update()
    for archive in archives:
        tqdm.write(f"wrote {archive} ({archive_bytes(archive) / 2**20:.1f} MiB)", file=sys.stderr)
    tqdm.write(f"built {len(archives)} archives in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return archives


def _check_before_building(
    spec: ModelSpec, spec_path: Path, names: list[str], model_store: Path, archive_format: str
) -> None:
    """What would fail at the end, refused before minutes of building."""
    if not spec.shards:
        raise InputError(
            f"{spec_path}: tables[].shard: no table names its shard; give each table one to build "
            "a distributed layout"
        )
    check_capturable(spec, split=True)
    if archive_format == "no-archive":
        for archive_name in names:
            check_replaceable(model_store / archive_name)


def _stage_shards(root: Path, spec: ModelSpec, weights: InferenceWeights, name: str) -> list[tuple[ShardRoute, Path]]:
    """Each shard's staged files (its tables' rows, byte for byte from the staged weights), and
    its route."""
    tables = weights.tables
    shards = []
    for shard in spec.shards:
        shard_spec = spec.shard_spec(shard)
        folder = root / shard / "extra"
        stage_shard(folder, shard_spec, tables, spec.limits.to_limits())
        route = ShardRoute(shard, shard_model_name(name, shard), shard_spec.feature_names, shard_spec.feature_dims)
        shards.append((route, folder))
    return shards


def stage_shard(folder: Path, shard_spec: ModelSpec, tables: dict[str, TableRows], model_limits: Limits) -> None:
    """A shard archive's files: its tables' rows out of ``tables`` (all the model's), and what a
    shard takes (``shard_schema``)."""
    rows = InferenceWeights({t.name: tables[t.name] for t in shard_spec.tables}, {}, None)
    stage_files(folder, shard_spec, DLRMFactory(shard_spec), rows, shard_schema(shard_spec, model_limits))


def _layout_service(whole: Path, plan: RemotePlan, shards: list[tuple[ShardRoute, Path]]) -> ScoringService:
    """The layout as it will serve: each shard loaded as its worker loads it and called in process
    through the same v2 bytes a remote call carries, the dense part loaded from its staged files."""
    callers = [InProcessShard(route, load_service(folder, HandlerOptions(Artifact.LOOKUPS))) for route, folder in shards]
    schema = InputSchema.from_file(whole / INPUTS)
    return ScoringService(schema, dense_host_model(whole, schema, plan, callers))


def _package_layout(
    whole: Path,
    shards: list[tuple[ShardRoute, Path]],
    plan: RemotePlan,
    serving: ServingConfig,
    dense_name: str,
    version: str,
    model_store: Path,
    archive_format: str,
) -> list[Path]:
    """One archive per shard, then the dense one."""
    archives = []
    # A shard call is a dense host's whole batch already: answered as it comes, not held
    # for others (TorchServe waits maxBatchDelay for a batch to fill; 0 means its default).
    shard_serving = dataclasses.replace(serving, batch_size=1, max_batch_delay_ms=1)
    for route, folder in shards:
        config = shard_serving.model_config(Artifact.LOOKUPS, (folder / WEIGHTS).stat().st_size, None)
        archives.append(package(folder, config, route.model, version, model_store, archive_format))
    dense_bytes = sum(f.stat().st_size for f in whole.glob("*.pt*"))
    # A dense host's batch may wait out a shard's fail-over: admission control, which
    # sheds requests that would queue longer than a few batch times, allows for it.
    wait_ms = serving.max_queue_wait_ms or int(2 * plan.deadline.max_ms)
    config = dataclasses.replace(serving, max_queue_wait_ms=wait_ms).model_config(Artifact.REMOTE, dense_bytes, None, plan)
    archives.append(package(whole, config, dense_name, version, model_store, archive_format))
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
        given = read_rows_file(rows)
        shard_of = {}
        for route in options.remote.shards:
            with Archive.open(_archive_in(store, route.model)) as shard:
                shard_of.update({t.name: route for t in archive_spec(shard).tables})
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
    """What a shard takes: the ids of its features for a dense host's whole forward. Pruned ids are
    counted where requests arrive, on the dense host, not again here."""
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
        features=tuple(dataclasses.replace(f, pruned_table=None) for f in model.features),
        weighted_ids=model.weighted_ids,
        out_of_range=model.out_of_range,
        limits=limits,
        output=Output.EMBEDDINGS,
        embedding_widths=tuple(shard_spec.feature_dims),
    )


def _stacked(spec: ModelSpec, factory: DLRMFactory, tables: InferenceWeights) -> bool:
    """Whether the architecture's dense part takes [N, F, D] (else [N, sum of widths])."""
    schema = input_schema(spec)
    decoder = RequestDecoder(schema)
    batch = coalesce([decoder.decode(synthetic_request(spec, 2, seed=0)).inputs], schema.tags)
    lookups = factory.lookups(InferenceWeights(tables.tables, {}, tables.buffers))
    with torch.inference_mode():
        return EagerModel(lookups, (schema.jagged,))(batch).dim() == 3
