"""DLRMFactory: a ``ModelSpec`` -> TorchRec models (DLRM or a context ranker), float and inference.

Two paths share the spec:

* build time (archive tool): ``float_model()`` -> ``load_checkpoint()`` -> ``quantize()`` gives
  ``InferenceWeights`` (per-table FBGEMM TBE rows + dense parameters), or ``random_weights()`` makes
  them without any float table; ``save_weights()`` writes them in FBGEMM's flat TBE layout;
* serve time (handler): ``load_weights()`` memory-maps that file and ``inference_model(weights)``
  builds the quantized model around it: unsharded on CPU it runs on the mapped buffers themselves,
  otherwise (sharded, or on CUDA) the rows are copied into the model's own tables.

Sharding uses TorchRec's inference sharding (planner + ``shard_quant_model``); the rows of every table
shard are copied from the unsharded TBE rows, so a sharded model computes exactly what the
unsharded one does.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from handlers.dense_precision import apply_dense_precision
from handlers.errors import CheckpointError
from handlers.models import EBC_PATH, build_model, split_model
from handlers.spec import ModelSpec, Pooling, ShardingType, TableSpec, WeightDtype

# Importing fbgemm_gpu registers the TBE operators that TorchRec's quantized modules call.
import fbgemm_gpu  # noqa: F401  isort: skip
from fbgemm_gpu.split_embedding_configs import SparseType  # isort: skip
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (  # isort: skip
    IntNBitTableBatchedEmbeddingBagsCodegen,
    rounded_row_size_in_bytes,
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
from torchrec.tensor_types import UInt4Tensor  # isort: skip

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


# FBGEMM pads each TBE row (scale/bias + packed values) to this many bytes. TorchRec's default, 16,
# turns a 68-byte int8 row of dim 64 into 80 bytes; 4 keeps the rows packed and the kernels exact.
ROW_ALIGNMENT = 4


@dataclasses.dataclass
class InferenceWeights:
    """Everything the served model needs, in its served dtypes.

    ``tables[name] = (rows, scale_bias)``: the TBE rows ``[R, packed bytes or dim]`` and, for int8/int4,
    the fp16 scale and bias per row as bytes ``[R, 4]`` (``None`` for fp32/fp16 tables).
    ``dense``: the float parameters of the bottom, interaction and top parts.
    ``buffers``: when the tables are views into FBGEMM's own weight layout (one flat uint8 buffer per
    table-batched module, as saved in ``weights.pt``), those buffers; an unsharded CPU model then
    runs on them directly, without a copy.
    """

    tables: dict[str, tuple[torch.Tensor, torch.Tensor | None]]
    dense: dict[str, torch.Tensor]
    buffers: list[torch.Tensor] | None = None


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
        return InferenceWeights(tables=tables, dense=_dense_state(float_model))

    def random_weights(self, seed: int) -> InferenceWeights:
        """Seeded random weights created straight in the served layout: no float table ever exists.

        For demos and benchmarks of models too large to hold in float (Criteo 1TB is 45 GB in fp32):
        peak memory is the quantized tables plus the dense layers. Each table dequantizes to
        uniform values in [-1/sqrt(rows), 1/sqrt(rows)], the scale of TorchRec's default init.
        """
        generator = torch.Generator().manual_seed(seed)
        model = self._quant_model("cpu")
        buffers = []
        for tbe in _tbes(model):
            buffer = torch.zeros(tbe.host_size, dtype=torch.uint8)  # padding stays 0: files reproduce
            _attach(tbe, buffer)
            buffers.append(buffer)
            for (_, _, _, sparse_type, *_), (values, scale_bias) in zip(
                tbe.embedding_specs, tbe.split_embedding_weights()
            ):
                _fill_random_table(values, scale_bias, sparse_type, generator)
        _refresh_table_buffers(model)
        torch.manual_seed(seed)  # the dense layers' own init
        dense_model = build_model(self.spec, self._float_ebc("meta"), "cpu")
        return InferenceWeights(_table_views(model), _dense_state(dense_model), buffers)

    def table_bytes(self) -> dict[str, int]:
        """Bytes each table takes in the served layout (rows x packed row size); allocates nothing."""
        return {
            name: rows * rounded_row_size_in_bytes(dim, sparse_type, ROW_ALIGNMENT)
            for tbe in _tbes(self._quant_model("cpu"))
            for name, rows, dim, sparse_type, *_ in tbe.embedding_specs
        }

    # -- the weights file ----------------------------------------------------------------------

    def save_weights(self, weights: InferenceWeights, path: str | Path) -> None:
        """One flat buffer per TBE, in FBGEMM's layout, plus the dense state: ``weights.pt``."""
        buffers = weights.buffers if weights.buffers is not None else self._pack(weights.tables)
        flat = {f"tbe.{i}": b for i, b in enumerate(buffers)}
        flat.update({f"dense.{k}": v for k, v in weights.dense.items()})
        torch.save(flat, path)

    def load_weights(self, path: str | Path) -> InferenceWeights:
        """Memory-maps ``weights.pt``: the tables cost page cache, shared by every process that maps
        the file, and no anonymous copy."""
        flat = torch.load(path, mmap=True, weights_only=True)
        model = self._quant_model("cpu")
        tbes = _tbes(model)
        buffers = [flat.get(f"tbe.{i}") for i in range(len(tbes))]
        if any(b is None for b in buffers) or f"tbe.{len(tbes)}" in flat:
            stored = sorted(k for k in flat if k.startswith("tbe."))
            raise CheckpointError(f"{path}: holds {stored}, the spec needs {len(tbes)} TBE buffers")
        for tbe, buffer in zip(tbes, buffers):
            _attach(tbe, buffer)
        _refresh_table_buffers(model)
        dense = {k[len("dense.") :]: v for k, v in flat.items() if k.startswith("dense.")}
        return InferenceWeights(_table_views(model), dense, buffers)  # type: ignore[arg-type]

    def inference_model(self, weights: InferenceWeights) -> nn.Module:
        """The served model: quantized TBE tables (sharded per the spec) + float dense layers.

        Tables are allocated directly in their quantized dtype; the float tables never exist. With
        ``weights.buffers`` (a loaded file) an unsharded CPU model uses them without a copy.
        """
        model = self._with_tables(weights)
        missing, unexpected = model.load_state_dict(weights.dense, strict=False)
        dense_missing = [k for k in missing if not k.startswith(EBC_PATH + ".")]
        if dense_missing or unexpected:
            raise CheckpointError(
                f"inference weights do not match the spec: missing {dense_missing}, "
                f"unexpected {unexpected}"
            )
        return apply_dense_precision(model, self.spec).eval()

    def lookups(self, weights: InferenceWeights) -> nn.Module:
        """Only the served model's sparse part (``handlers.models.split_model``): its tables, as in
        ``inference_model``; ``weights.dense`` is not needed."""
        sparse, _ = split_model(self._with_tables(weights))
        return sparse.eval()

    def _with_tables(self, weights: InferenceWeights) -> nn.Module:
        """The model with its served tables filled in (zero-copy where possible), dense layers not
        loaded yet."""
        device = self.spec.sharding.device
        model = self._quant_model(device)
        buffers = weights.buffers
        zero_copy = buffers is not None and device == "cpu" and not self.spec.is_sharded
        if buffers is not None and zero_copy:
            tbes = _tbes(model)
            if len(tbes) != len(buffers):
                raise CheckpointError(
                    f"inference weights hold {len(buffers)} TBE buffers, the spec needs {len(tbes)}"
                )
            for tbe, buffer in zip(tbes, buffers):
                _attach(tbe, buffer)
        elif self.spec.is_sharded:
            model = self._shard(model)  # the sharded modules allocate their own weights
        else:
            for tbe in _tbes(model):
                _allocate(tbe)
        _refresh_table_buffers(model)
        if not zero_copy:
            _copy_table_rows(model, weights.tables, {t.name: t.rows for t in self.spec.tables})
        return model

    # -- helpers -------------------------------------------------------------------------------

    def _quant_model(self, device: str) -> nn.Module:
        """The model with quantized tables whose weight buffers are not allocated yet."""
        # The float EBC only gives the model its shapes; on ``meta`` it allocates nothing.
        model = build_model(self.spec, self._float_ebc("meta"), device)
        with _tbe_weights_deferred():
            model.sparse_arch.embedding_bag_collection = QuantEmbeddingBagCollection(
                tables=self.table_configs(with_dtypes=True),
                is_weighted=self.spec.weighted_ids,
                device=torch.device(device),
                output_dtype=torch.float,
                register_tbes=True,
                row_alignment=ROW_ALIGNMENT,
            )
        return model

    def _pack(self, tables: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
        """Per-table rows -> FBGEMM's flat TBE buffers (padding zeroed, so files are reproducible)."""
        model = self._quant_model("cpu")
        buffers = []
        for tbe in _tbes(model):
            buffer = torch.zeros(tbe.host_size, dtype=torch.uint8)
            _attach(tbe, buffer)
            buffers.append(buffer)
        _refresh_table_buffers(model)
        _copy_table_rows(model, tables, {t.name: t.rows for t in self.spec.tables})
        return buffers

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


@contextlib.contextmanager
def _tbe_weights_deferred() -> Iterator[None]:
    """TBEs built inside this block get a weight buffer on ``meta``: the right size, no memory.

    TorchRec builds each FBGEMM TBE and at once allocates and zero-fills its whole weight buffer.
    For tables that come from a memory-mapped file, or are filled in place, that is a wasted second
    copy (12 GB for Criteo 1TB in int8). ``_attach`` or ``_allocate`` gives them real weights.
    """
    original = IntNBitTableBatchedEmbeddingBagsCodegen.initialize_weights

    def on_meta(tbe: IntNBitTableBatchedEmbeddingBagsCodegen) -> None:
        tbe.weights_host = torch.empty(tbe.host_size, dtype=torch.uint8, device="meta")
        tbe.weights_dev = torch.empty(tbe.dev_size, dtype=torch.uint8, device="meta")
        tbe.weight_initialized = True

    IntNBitTableBatchedEmbeddingBagsCodegen.initialize_weights = on_meta
    try:
        yield
    finally:
        IntNBitTableBatchedEmbeddingBagsCodegen.initialize_weights = original


def _attach(tbe: IntNBitTableBatchedEmbeddingBagsCodegen, buffer: torch.Tensor) -> None:
    """Makes ``buffer`` (flat uint8, FBGEMM's layout for this TBE) the TBE's host weights, uncopied."""
    if tbe.dev_size or tbe.uvm_size:
        raise CheckpointError("only CPU-resident TBE weights can be attached without a copy")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != tbe.host_size:
        raise CheckpointError(
            f"TBE buffer for tables {[s[0] for s in tbe.embedding_specs]} must be uint8 "
            f"[{tbe.host_size}], got {buffer.dtype} {list(buffer.shape)}"
        )
    tbe.weights_host = buffer
    tbe.initialize_logical_weights_placements_and_offsets()  # what FBGEMM's allocation also sets


def _allocate(tbe: IntNBitTableBatchedEmbeddingBagsCodegen) -> None:
    """Gives a deferred TBE its own zeroed weights on its device."""
    tbe.weight_initialized = False
    tbe.initialize_weights()


def _refresh_table_buffers(model: nn.Module) -> None:
    """Points the quantized EBC's per-table ``weight`` buffers (what ``state_dict`` shows) at the
    TBEs' current weights; TorchRec registers them as views once, at construction."""
    for qebc in model.modules():
        if not isinstance(qebc, QuantEmbeddingBagCollection):
            continue
        for tbe in qebc._emb_modules:  # TorchRec keeps no public handle on them
            for (name, *_), (rows, *_) in zip(
                tbe.embedding_specs, tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)
            ):
                table = qebc.embedding_bags[name]
                table.weight = UInt4Tensor(rows) if isinstance(table.weight, UInt4Tensor) else rows


def _table_views(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    return {
        name: (rows, scale_bias)
        for tbe in _tbes(model)
        for (name, *_), (rows, scale_bias) in zip(tbe.embedding_specs, tbe.split_embedding_weights())
    }


def _dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if not k.startswith(EBC_PATH + ".")
    }


def _fill_random_table(
    values: torch.Tensor,
    scale_bias: torch.Tensor | None,
    sparse_type: SparseType,
    generator: torch.Generator,
) -> None:
    """Random rows of one table, dequantizing to uniform [-a, a] with a = 1/sqrt(rows).

    ``values``: uint8 [R, row bytes]; ``scale_bias``: uint8 [R, 4] (fp16 scale, then fp16 bias)
    for int8/int4, None for fp16/fp32. Filled in chunks of 1M rows to bound temporary memory.
    """
    rows = values.shape[0]
    bound = rows**-0.5
    chunk = 1 << 20
    for start in range(0, rows, chunk):
        part = values[start : min(rows, start + chunk)]
        if scale_bias is None:  # fp16 / fp32 rows hold the values themselves
            floats = part.view(torch.float16 if sparse_type == SparseType.FP16 else torch.float32)
            floats.copy_(torch.rand(floats.shape, generator=generator) * 2 * bound - bound)
        else:  # int8: one value per byte; int4: two per byte, both uniform in random bytes
            part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, generator=generator))
    if scale_bias is not None:
        levels = 255 if sparse_type == SparseType.INT8 else 15
        params = scale_bias.view(torch.float16)  # [R, 2]
        params[:, 0] = 2 * bound / levels
        params[:, 1] = -bound


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
