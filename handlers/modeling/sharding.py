"""TorchRec inference sharding of the quantized tables: its planner places each table, within the
layouts that are exact on torchrec 1.8 (see ``handlers.modeling.spec``)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from handlers.modeling.embedding_modules import find_collections
from handlers.modeling.spec import ModelSpec, Pooling, ShardingType, TableSpec
from handlers.runtime.quiet import quieter

from torchrec.distributed.embedding_types import EmbeddingComputeKernel  # isort: skip
from torchrec.distributed import global_settings  # isort: skip
from torchrec.distributed.planner.types import ParameterConstraints  # isort: skip
from torchrec.inference.modules import shard_quant_model  # isort: skip
from torchrec import KeyedJaggedTensor  # isort: skip


def shard(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """The model with its quantized tables sharded over ``spec.sharding``'s ranks."""
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[s.value for s in allowed_sharding(t)],
            compute_kernels=[EmbeddingComputeKernel.QUANT.value],
        )
        for t in spec.tables
    }
    device = spec.sharding.device
    collections = {c.path: c.tables for c in find_collections(model)}
    # TorchRec's own shard_quant_model builds its planner's topology directly, and its planner
    # then warns that a topology should come from its factory; the FBGEMM modules it builds log
    # their feature gates on the root logger.
    with _propagate_device(), quieter("", "torchrec.distributed.planner.types"):
        sharded, _plan = shard_quant_model(
            model,
            world_size=spec.sharding.world_size,
            compute_device=device,
            sharding_device=device,
            constraints=constraints,
        )
        _build_lazy_parts(sharded, spec, collections)
    return sharded


def _build_lazy_parts(sharded: nn.Module, spec: ModelSpec, collections: dict[str, tuple[str, ...]]) -> None:
    """A sharded EBC builds its input distribution on its first call, reading TorchRec's device
    setting then: one call on an empty batch, while the setting holds, builds it on our device.
    ``collections``: each EBC's path and its tables."""
    by_name = {t.name: t for t in spec.tables}
    for path, tables in collections.items():
        names = [f for name in tables for f in by_name[name].features]
        empty = KeyedJaggedTensor.from_lengths_sync(
            keys=names,
            values=torch.empty(0, dtype=torch.int64),
            lengths=torch.zeros(len(names), dtype=torch.int64),
            weights=torch.empty(0) if spec.weighted_ids else None,
        )
        with torch.inference_mode():
            sharded.get_submodule(path)(empty)


def allowed_sharding(table: TableSpec) -> list[ShardingType]:
    """The layouts the planner may pick: the spec's, or for ``auto`` the ones that are exact here.

    Column-wise is broken for quantized tables in torchrec 1.8, and row-wise is wrong for mean
    pooling, so ``auto`` never picks them.
    """
    if table.sharding != ShardingType.AUTO:
        return [table.sharding]
    if table.pooling == Pooling.MEAN:
        return [ShardingType.TABLE_WISE]
    return [ShardingType.TABLE_WISE, ShardingType.ROW_WISE]


@contextlib.contextmanager
def _propagate_device() -> Iterator[None]:
    """TorchRec's switch (a process-wide setting, restored on exit) that keeps inference shards on
    the sharding device; without it every non-meta shard goes to CUDA. It is read when a sharded
    module builds its parts, so everything is built inside this block."""
    before = global_settings.get_propogate_device()
    global_settings.set_propogate_device(True)
    try:
        yield
    finally:
        global_settings.set_propogate_device(before)
