"""Loading what an archive folder serves, as a worker does: the runtime's ``ScoringService`` over
the runner of the artifact that the archive's ``handler`` options name.

Graph artifacts (``aoti``, ``exported``, a split of those, a dense host's ``remote``) load with the
runtime alone: torch, the FBGEMM operators and ``handlers.runtime``. Only artifacts that run
TorchRec modules (``eager``, a split with eager lookups, an embedding shard's ``lookups``) import
``handlers.modeling``, and with it TorchRec and TorchAO, so a graph worker never pays for them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from handlers.runtime.artifacts import Artifact, GraphModel, Runner
from handlers.runtime.device import worker_device
from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import SPEC, WEIGHTS
from handlers.runtime.inputs import InputSchema
from handlers.runtime.options import HandlerOptions
from handlers.runtime.pruned_ids import PrunedIdCounter
from handlers.runtime.remote.lookups import Shard, ShardCaller, ShardedLookups
from handlers.runtime.remote.plan import RemotePlan, read_placement
from handlers.runtime.service import ScoringService
from handlers.runtime.split import SplitModel, dense_tags, sparse_tags
from handlers.runtime.unseen_ids import UnseenIdCounter

logger = logging.getLogger(__name__)

SHARD_CONNECT_S = 10.0  # how long a dense host's worker start waits for each shard's replicas


def load_service(
    model_dir: str | Path,
    options: HandlerOptions,
    gpu_id: int | None = None,
    model_name: str | None = None,
    tables_file: Path | None = None,
    model_version: str | None = None,
) -> ScoringService:
    """The archive folder's model behind a scoring service; ``gpu_id``: the GPU TorchServe gave
    this worker (used by models and dense parts that run on ``cuda``); ``model_name``: the name it
    was registered under (default: the spec's), ``model_version`` its version; ``tables_file``: a copy of the archive's weights
    file that holds the tables, mapped instead of it (the working copy that deltas change)."""
    model_dir = Path(model_dir)
    schema = Archive(model_dir).inputs
    pruned_ids = PrunedIdCounter.of_archive(model_dir, schema)  # before the model: a missing file is named first
    runner = load_runner(model_dir, schema, options, gpu_id, tables_file)
    return ScoringService(
        schema, runner, model_name, threads_for=options.threads_for, model_version=model_version,
        pruned_ids=pruned_ids,
        unseen_ids=UnseenIdCounter.of_runner(schema, runner),
    )


def load_archive(archive: Archive) -> ScoringService:
    """A built archive's model behind a scoring service, loaded in this process exactly as a
    TorchServe worker loads it (a ``.mar`` is unpacked into the archive's folder first)."""
    return load_service(archive.unpacked(), archive.options)


def load_runner(
    model_dir: Path,
    schema: InputSchema,
    options: HandlerOptions,
    gpu_id: int | None,
    tables_file: Path | None = None,
) -> Runner:
    if options.artifact == Artifact.EAGER:
        return _eager_model(model_dir, gpu_id, tables_file)
    if options.artifact == Artifact.LOOKUPS:  # an embedding shard
        return _eager_lookups(model_dir, tables_file)
    if options.artifact == Artifact.REMOTE:  # a dense host: its shards where the placement says
        assert options.remote is not None  # HandlerOptions pairs a remote artifact with its plan
        plan = options.remote.placed(read_placement())
        callers = [ShardCaller(r, plan.deadline) for r in plan.shards]
        for caller in callers:
            missing = caller.connect(timeout_s=SHARD_CONNECT_S)
            if missing:
                logger.warning("shard %s: no connection yet to %s", caller.route.name, ", ".join(missing))
        return dense_host_model(model_dir, schema, plan, callers)
    if options.artifact != Artifact.SPLIT:
        return GraphModel(model_dir / options.artifact.file_name(), options.artifact, schema.tags, weights=tables_file)
    plan = options.split
    assert plan is not None  # HandlerOptions pairs a split artifact with its plan
    dense = GraphModel(
        model_dir / plan.dense_file,
        plan.dense,
        dense_tags(schema.tags),
        worker_device(plan.dense_device, gpu_id),
    )
    if plan.sparse == Artifact.EAGER:
        sparse = _eager_lookups(model_dir, tables_file)
    else:
        sparse = GraphModel(model_dir / plan.sparse_file, plan.sparse, sparse_tags(schema.tags), weights=tables_file)
    return SplitModel(sparse, dense, schema.tags)


def dense_host_model(model_dir: Path, schema: InputSchema, plan: RemotePlan, shards: Sequence[Shard]) -> SplitModel:
    """A dense host's model: lookups on ``shards`` (remote, or in process when verifying a
    build), then the archive's dense part."""
    lookups = ShardedLookups(shards, schema.feature_names, schema.jagged.name, schema.weighted_ids, plan.stacked)
    dense = GraphModel(model_dir / plan.dense_file, plan.dense, dense_tags(schema.tags))
    return SplitModel(lookups, dense, schema.tags)


def _eager_model(model_dir: Path, gpu_id: int | None, weights: Path | None) -> Runner:
    from handlers.modeling import eager  # TorchRec, only for artifacts that run its modules
    from handlers.modeling.archive_code import use_archive_code
    from handlers.modeling.registry import load_spec

    use_archive_code(model_dir)
    spec = load_spec(model_dir / SPEC)
    device = worker_device(spec.sharding.device, gpu_id)
    return eager.load_eager_model(spec, weights or model_dir / WEIGHTS, device)


def _eager_lookups(model_dir: Path, weights: Path | None) -> Runner:
    from handlers.modeling import eager  # TorchRec, only for artifacts that run its modules
    from handlers.modeling.archive_code import use_archive_code
    from handlers.modeling.registry import load_spec

    use_archive_code(model_dir)
    spec = load_spec(model_dir / SPEC)
    return eager.load_eager_lookups(spec, weights or model_dir / WEIGHTS)
