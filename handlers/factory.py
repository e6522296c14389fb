"""DLRMFactory: a ``ModelSpec`` -> TorchRec models (DLRM or a context ranker), float and inference.

Two paths share the spec:

* build time (archive tool): ``float_model()`` -> ``load_checkpoint()`` -> ``quantize()`` gives
  ``InferenceWeights`` (per-table FBGEMM TBE rows + dense parameters), saved into the archive;
* serve time (handler): ``inference_model(weights)`` builds the quantized, optionally sharded model
  directly in its quantized form (no float tables are ever allocated) and copies the rows in.

Sharding uses TorchRec's inference sharding (planner + ``shard_quant_model``); the rows of every table
shard are copied from the unsharded TBE rows, so a sharded model computes exactly what the
unsharded one does.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from torch import nn

from handlers.errors import CheckpointError
from handlers.models import EBC_PATH, build_model
from handlers.spec import ModelSpec, Pooling, ShardingType, TableSpec, WeightDtype

# Importing fbgemm_gpu registers the TBE operators that TorchRec's quantized modules call.
import fbgemm_gpu  # noqa: F401  isort: skip
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (  # isort: skip
    IntNBitTableBatchedEmbeddingBagsCodegen,
)
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig  # isort: skip
from torchrec.distributed.embedding_types import EmbeddingComputeKernel  # isort: skip
from torchrec.distributed.global_settings import set_propogate_device  # isort: skip
from torchrec.distributed.planner.types import ParameterConstraints  # isort: skip
from torchrec.inference.modules import quantize_inference_model, shard_quant_model  # isort: skip
from torchrec.modules.embedding_configs import DataType, PoolingType  # isort: skip
from torchrec.quant.embedding_modules import (  # isort: skip
    EmbeddingBagCollection as QuantEmbeddingBagCollection,
)

_TORCHREC_DTYPE = {
    WeightDtype.FP32: DataType.FP32,
    WeightDtype.FP16: DataType.FP16,
    WeightDtype.INT8: DataType.INT8,
    WeightDtype.INT4: DataType.INT4,
}
_QUANT_DTYPE = {
    WeightDtype.FP32: torch.float32,
    WeightDtype.FP16: torch.float16,
    WeightDtype.INT8: torch.qint8,
    WeightDtype.INT4: torch.quint4x2,
}
_POOLING = {Pooling.SUM: PoolingType.SUM, Pooling.MEAN: PoolingType.MEAN}


@dataclasses.dataclass
class InferenceWeights:
    """Everything the served model needs, in its served dtypes.

    ``tables[name] = (rows, scale_bias)``: the TBE rows ``[R, packed bytes or dim]`` and, for int8/int4,
    the fp16 scale and bias per row ``[R, 4]`` (``None`` for fp32/fp16 tables).
    ``dense``: the float parameters of the bottom, interaction and top parts.
    """

    tables: dict[str, tuple[torch.Tensor, torch.Tensor | None]]
    dense: dict[str, torch.Tensor]

    def save(self, path: str | Path) -> None:
        flat: dict[str, torch.Tensor] = {f"dense.{k}": v for k, v in self.dense.items()}
        for name, (rows, scale_bias) in self.tables.items():
            flat[f"tables.{name}.rows"] = rows.contiguous()
            if scale_bias is not None:
                flat[f"tables.{name}.scale_bias"] = scale_bias.contiguous()
        torch.save(flat, path)

    @classmethod
    def load(cls, path: str | Path) -> "InferenceWeights":
        """Memory-maps the file: loading costs page cache, not a second copy in anonymous memory."""
        flat = torch.load(path, mmap=True, weights_only=True)
        dense = {k[len("dense.") :]: v for k, v in flat.items() if k.startswith("dense.")}
        tables: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for key, value in flat.items():
            if key.startswith("tables.") and key.endswith(".rows"):
                name = key[len("tables.") : -len(".rows")]
                tables[name] = (value, flat.get(f"tables.{name}.scale_bias"))
        return cls(tables=tables, dense=dense)


class DLRMFactory:
    """Builds the spec's model (``handlers.models``), float or served. Holds no model state.

    >>> factory = DLRMFactory(ModelSpec.from_yaml("config/models/tiny.yaml"))
    >>> float_model = factory.float_model(seed=0)
    >>> served = factory.inference_model(factory.quantize(float_model))
    >>> served(dense_features, sparse_features)   # [B, 4], KJT -> logits [B, 1]
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    # -- float (training-shaped) model ------------------------------------------------------

    def table_configs(self, *, with_dtypes: bool = False) -> list[EmbeddingBagConfig]:
        return [
            EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.rows,
                embedding_dim=t.dim,
                feature_names=list(t.features),
                pooling=_POOLING[t.pooling],
                data_type=_TORCHREC_DTYPE[t.weight_dtype] if with_dtypes else DataType.FP32,
            )
            for t in self.spec.tables
        ]

    def float_model(self, seed: int | None = None, device: str = "cpu") -> nn.Module:
        """The float model as trained; random weights from ``seed`` until a checkpoint is loaded."""
        if seed is not None:
            torch.manual_seed(seed)
        return build_model(self.spec, self._float_ebc(device), device).eval()

    def load_checkpoint(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads a trained state dict strictly, after the spec's name mapping.

        Raises ``CheckpointError`` listing every missing, unexpected and mis-shaped key at once.
        """
        mapping = self.spec.checkpoint_mapping
        mapped = {mapping.apply(k): v for k, v in state_dict.items()}
        expected = model.state_dict()
        missing = sorted(set(expected) - set(mapped))
        unexpected = sorted(set(mapped) - set(expected))
        misshaped = sorted(
            f"{k}: checkpoint {tuple(mapped[k].shape)} vs model {tuple(expected[k].shape)}"
            for k in set(mapped) & set(expected)
            if mapped[k].shape != expected[k].shape
        )
        problems = [
            f"{label}: {', '.join(keys)}"
            for label, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("mis-shaped", misshaped),
            )
            if keys
        ]
        if problems:
            raise CheckpointError(
                "checkpoint does not match the spec (after checkpoint_mapping): "
                + "; ".join(problems)
            )
        model.load_state_dict(mapped, strict=True)

    @staticmethod
    def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
        """A saved state dict, plain or wrapped as ``{"state_dict": ...}`` / ``{"model": ...}``."""
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        for wrapper in ("state_dict", "model"):
            if isinstance(obj, dict) and set(obj) == {wrapper}:
                obj = obj[wrapper]
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointError(f"{path}: expected a state dict of tensors")
        return obj

    # -- inference model -----------------------------------------------------------------------

    def quantize(self, float_model: nn.Module) -> InferenceWeights:
        """Quantizes each table to its spec dtype with TorchRec (FBGEMM row-wise quantization)."""
        quantized = quantize_inference_model(
            copy.deepcopy(float_model),
            per_table_weight_dtype={t.name: _QUANT_DTYPE[t.weight_dtype] for t in self.spec.tables},
        )
        tables: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for tbe in _tbes(quantized):
            for (name, *_), (rows, scale_bias) in zip(
                tbe.embedding_specs, tbe.split_embedding_weights()
            ):
                tables[name] = (rows.clone(), None if scale_bias is None else scale_bias.clone())
        dense = {
            k: v.detach().clone()
            for k, v in float_model.state_dict().items()
            if not k.startswith(EBC_PATH + ".")
        }
        return InferenceWeights(tables=tables, dense=dense)

    def inference_model(self, weights: InferenceWeights) -> nn.Module:
        """The served model: quantized TBE tables (sharded per the spec) + float dense layers.

        Tables are allocated directly in their quantized dtype; the float tables never exist.
        """
        device = self.spec.sharding.device
        # The float EBC only gives the model its shapes; on ``meta`` it allocates nothing.
        model = build_model(self.spec, self._float_ebc("meta"), device)
        model.sparse_arch.embedding_bag_collection = QuantEmbeddingBagCollection(
            tables=self.table_configs(with_dtypes=True),
            is_weighted=self.spec.weighted_ids,
            device=torch.device(device),
            output_dtype=torch.float,
            register_tbes=True,
        )
        if self.spec.is_sharded:
            model = self._shard(model)
        missing, unexpected = model.load_state_dict(weights.dense, strict=False)
        dense_missing = [k for k in missing if not k.startswith(EBC_PATH + ".")]
        if dense_missing or unexpected:
            raise CheckpointError(
                f"inference weights do not match the spec: missing {dense_missing}, "
                f"unexpected {unexpected}"
            )
        _copy_table_rows(model, weights.tables, {t.name: t.rows for t in self.spec.tables})
        return model.eval()

    # -- helpers -------------------------------------------------------------------------------

    def _float_ebc(self, device: str) -> EmbeddingBagCollection:
        return EmbeddingBagCollection(
            tables=self.table_configs(),
            is_weighted=self.spec.weighted_ids,
            device=torch.device(device),
        )

    def _shard(self, model: nn.Module) -> nn.Module:
        """TorchRec's planner places each table, restricted to the sharding types the spec allows."""
        # Without this, TorchRec's inference sharding puts every non-meta shard on CUDA.
        set_propogate_device(True)
        constraints = {
            t.name: ParameterConstraints(
                sharding_types=[s.value for s in _allowed_sharding(t)],
                compute_kernels=[EmbeddingComputeKernel.QUANT.value],
            )
            for t in self.spec.tables
        }
        device = self.spec.sharding.device
        sharded, _plan = shard_quant_model(
            model,
            world_size=self.spec.sharding.world_size,
            compute_device=device,
            sharding_device=device,
            constraints=constraints,
        )
        return sharded


def _allowed_sharding(table: TableSpec) -> list[ShardingType]:
    """The layouts the planner may pick: the spec's, or for ``auto`` the ones that are exact here.

    Column-wise is broken for quantized tables in torchrec 1.8, and row-wise is wrong for mean
    pooling (see ``handlers.spec``), so ``auto`` never picks them.
    """
    if table.sharding != ShardingType.AUTO:
        return [table.sharding]
    if table.pooling == Pooling.MEAN:
        return [ShardingType.TABLE_WISE]
    return [ShardingType.TABLE_WISE, ShardingType.ROW_WISE]


def _tbes(model: nn.Module) -> list[IntNBitTableBatchedEmbeddingBagsCodegen]:
    """The FBGEMM table-batched embedding modules of a model, in rank order."""
    return [m for m in model.modules() if isinstance(m, IntNBitTableBatchedEmbeddingBagsCodegen)]


def _copy_table_rows(
    model: nn.Module,
    tables: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
    table_rows: dict[str, int],
) -> None:
    """Copies each table's rows into the TBE shards that hold them.

    Shards of a table appear in rank order with ascending row offsets (TorchRec lays out row-wise
    shards that way), so each shard takes the next ``shard_rows`` rows.
    """
    if set(tables) != set(table_rows):
        raise CheckpointError(
            f"inference weights hold tables {sorted(tables)}, the spec has {sorted(table_rows)}"
        )
    next_row = dict.fromkeys(table_rows, 0)
    for tbe in _tbes(model):
        for (name, shard_rows, *_), (dst_rows, dst_scale_bias) in zip(
            tbe.embedding_specs, tbe.split_embedding_weights()
        ):
            src_rows, src_scale_bias = tables[name]
            start = next_row[name]
            dst_rows.copy_(src_rows[start : start + shard_rows])
            if dst_scale_bias is not None:
                if src_scale_bias is None:
                    raise CheckpointError(f"table {name}: quantized rows come without scale/bias")
                dst_scale_bias.copy_(src_scale_bias[start : start + shard_rows])
            next_row[name] = start + shard_rows
    short = {n: f"{r}/{table_rows[n]}" for n, r in next_row.items() if r != table_rows[n]}
    if short:
        raise CheckpointError(f"table rows not fully placed in the sharded model: {short}")
