"""DLRMFactory: a spec -> its TorchRec model (any registered architecture), float or served.

Two paths share the spec:

* build time (archive tool): ``float_model()`` -> ``load_checkpoint()`` -> ``quantize()`` gives
  ``InferenceWeights`` (per-table FBGEMM TBE rows + dense parameters), or ``random_weights()`` makes
  them without any float table; ``save_weights()`` writes them in FBGEMM's flat TBE layout;
* serve time (eager artifacts): ``load_weights()`` memory-maps that file and
  ``inference_model(weights)`` builds the quantized model around it: unsharded on the cpu it runs on
  the mapped buffers themselves, otherwise (sharded, or on CUDA) the rows are copied into the
  model's own tables.

Sharding uses TorchRec's inference sharding (``handlers.modeling.sharding``); the rows of every
table shard are copied from the unsharded TBE rows, so a sharded model computes exactly what the
unsharded one does.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from handlers.modeling import checkpoint, pruning, raw_ids, tbe
from handlers.modeling.dense_precision import apply_dense_precision
from handlers.modeling.embedding_modules import (
    EmbeddingTables,
    check_collections,
    find_collections,
    quantize_in_place,
    table_prefixes,
    table_weights,
    without_tables,
)
from handlers.modeling.errors import CheckpointError
from handlers.modeling.registry import architecture_of, check_forward
from handlers.modeling.sharding import shard
from handlers.modeling.spec import ModelSpec, WeightDtype
from handlers.modeling.weights import (
    InferenceWeights,
    TableRows,
    copy_table_rows,
    fill_random_table,
    load_weights_file,
    save_weights_file,
)
from handlers.runtime.freshness.layout import TableLayout, TablesLayout, fingerprint
from handlers.runtime.slot_maps import SlotMap

from fbgemm_gpu.split_table_batched_embeddings_ops_inference import rounded_row_size_in_bytes  # isort: skip
from torchrec.inference.modules import quantize_inference_model, set_pruning_data  # isort: skip

_QUANT_DTYPE = {
    WeightDtype.FP32: torch.float32,
    WeightDtype.FP16: torch.float16,
    WeightDtype.INT8: torch.qint8,
    WeightDtype.INT4: torch.quint4x2,
    WeightDtype.INT2: torch.quint2x4,
}


class DLRMFactory:
    """Builds the spec's model, float or served. Holds no model state.

    >>> factory = DLRMFactory(load_spec("config/models/tiny.yaml"))
    >>> float_model = factory.float_model(seed=0)
    >>> served = factory.inference_model(factory.quantize(float_model))
    >>> served(dense_features, sparse_features)   # [B, 4], KJT -> logits [B, 1]
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.architecture = architecture_of(spec)
        self.kept = pruning.kept_ids(spec)  # pruned tables' kept ids ({} when none is pruned)

    # -- float (training-shaped) model ------------------------------------------------------

    def float_model(self, seed: int | None = None, device: str = "cpu") -> nn.Module:
        """The float model as trained; random weights from ``seed`` until a checkpoint is loaded."""
        if seed is not None:
            torch.manual_seed(seed)
        return self._build(torch.device(device), torch.device(device)).eval()

    def load_checkpoint(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> str | None:
        """Loads a trained state dict strictly, after the spec's ``checkpoint_mapping`` (or a
        training wrapper's prefix it detects); returns what it stripped, if anything."""
        return checkpoint.load_checkpoint(model, state_dict, self.spec.checkpoint_mapping)

    def dense_weights(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The float dense weights of a trained checkpoint, whole or without its tables (what a
        dense delta is made from): no table is allocated."""
        torch.manual_seed(0)  # the dense layers' init, all overwritten
        model = self._build(torch.device("meta"), torch.device("cpu"))
        tables = without_tables(model)
        checkpoint.load_checkpoint(model, state_dict, self.spec.checkpoint_mapping, skip=tables)
        return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith(tables)}

    # -- served weights ------------------------------------------------------------------------

    def quantize(self, float_model: nn.Module) -> InferenceWeights:
        """Quantizes each table to its spec dtype with TorchRec (FBGEMM row-wise quantization); a
        pruned table keeps the rows of its kept ids, in order."""
        model = copy.deepcopy(float_model)
        if self.kept:  # a pruned table's kept rows first: TorchRec quantizes the first pruned_to
            weights = table_weights(model)
            with torch.no_grad():
                for name, ids in self.kept.items():
                    weights[name][: len(ids)] = weights[name][ids].clone()
            set_pruning_data(model, {t.name: t.pruned_to for t in self.spec.tables if t.pruned_to})
        quantized = quantize_inference_model(
            model, per_table_weight_dtype={t.name: _QUANT_DTYPE[t.weight_dtype] for t in self.spec.tables}
        )
        tables = {
            name: (rows.clone(), None if scale_bias is None else scale_bias.clone())
            for name, (rows, scale_bias) in _table_views(quantized).items()
        }
        maps = self._fused(raw_ids.slot_maps(float_model))
        return InferenceWeights(tables, _dense_state(float_model), slot_maps=maps)

    def random_weights(self, seed: int) -> InferenceWeights:
        """Seeded random weights created straight in the served layout: no float table ever exists.

        For demos and benchmarks of models too large to hold in float (Criteo 1TB is 45 GB in fp32):
        peak memory is the quantized tables plus the dense layers. Each table dequantizes to
        uniform values in [-1/sqrt(rows), 1/sqrt(rows)], the scale of TorchRec's default init.
        """
        generator = torch.Generator().manual_seed(seed)
        model = self._quant_model(torch.device("cpu"))
        buffers = self._zeroed_buffers(model)
        for module in tbe.tbes(model):
            for (_, _, _, sparse_type, *_), (values, scale_bias) in zip(
                module.embedding_specs, module.split_embedding_weights()
            ):
                fill_random_table(values, scale_bias, sparse_type, generator)
        maps = {t.name: raw_ids.random_slot_map(t, generator) for t in self.spec.tables if t.remap}
        tables = _table_views(model)
        for table in self.spec.tables:
            if table.remap is not None and table.remap.zero_row:  # MCH's default row held at zero: scale and bias 0
                for part in tables[table.name]:
                    if part is not None:
                        part[-1].zero_()
        return InferenceWeights(tables, self.random_dense(seed), buffers, self._fused(maps))

    def random_dense(self, seed: int) -> dict[str, torch.Tensor]:
        """The dense layers' own init from ``seed``, as float weights; no table is allocated."""
        torch.manual_seed(seed)
        return _dense_state(self._build(torch.device("meta"), torch.device("cpu")))

    def table_bytes(self) -> dict[str, int]:
        """Bytes each table takes in the served layout (rows x packed row size); allocates nothing."""
        return {
            name: rows * rounded_row_size_in_bytes(dim, sparse_type, tbe.ROW_ALIGNMENT)
            for module in tbe.tbes(self._quant_model(torch.device("cpu")))
            for name, rows, dim, sparse_type, *_ in module.embedding_specs
        }

    def tables_layout(self, weights_file: str | Path) -> TablesLayout:
        """Where each table's rows lie in the TBE buffers of a saved ``weights.pt`` (what a delta
        writes into), with the fingerprint of its contents."""
        model = self._quant_model(torch.device("cpu"))
        dtypes = {t.name: t.weight_dtype.value for t in self.spec.tables}
        raw = set(self.spec.raw_id_tables)
        tables = []
        buffers, dense, _ = load_weights_file(Path(weights_file), len(tbe.tbes(model)))
        self._attach_all(model, buffers)
        for index, (module, buffer) in enumerate(zip(tbe.tbes(model), buffers)):
            views = module.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)
            for (name, rows, dim, sparse_type, *_), (view, *_) in zip(module.embedding_specs, views):
                row_bytes = rounded_row_size_in_bytes(dim, sparse_type, tbe.ROW_ALIGNMENT)
                offset = view.data_ptr() - buffer.data_ptr()  # FBGEMM places the tables itself
                if view.shape[0] > 1 and view.stride(0) != row_bytes:
                    raise ValueError(f"table {name}: rows {view.stride(0)} bytes apart, expected {row_bytes}")
                tables.append(TableLayout(name, dtypes[name], dim, rows, row_bytes, index, offset, name in raw))
        return TablesLayout(fingerprint(buffers, dense), tuple(tables), self.spec.is_sharded)

    def save_weights(self, weights: InferenceWeights, path: str | Path) -> None:
        """``weights.pt``: one flat buffer per TBE, in FBGEMM's layout, plus the dense state."""
        buffers = weights.buffers
        if buffers is None:
            model = self._quant_model(torch.device("cpu"))
            buffers = self._zeroed_buffers(model)
            self._copy_rows(model, weights.tables)
        save_weights_file(buffers, weights.dense, Path(path), weights.slot_maps)

    def load_weights(self, path: str | Path) -> InferenceWeights:
        """Memory-maps ``weights.pt``: the tables cost page cache, shared by every process that maps
        the file, and no anonymous copy."""
        model = self._quant_model(torch.device("cpu"))
        modules = tbe.tbes(model)
        buffers, dense, slot_maps = load_weights_file(Path(path), len(modules))
        self._attach_all(model, buffers)
        return InferenceWeights(_table_views(model), dense, buffers, slot_maps)

    # -- served model ----------------------------------------------------------------------------

    def inference_model(
        self, weights: InferenceWeights, device: torch.device | None = None
    ) -> nn.Module:
        """The served model: quantized TBE tables (sharded per the spec) + dense layers in the
        spec's precision, on ``device`` (default: the spec's).

        Tables are allocated directly in their quantized dtype; the float tables never exist. With
        ``weights.buffers`` (a loaded file) an unsharded CPU model uses them without a copy.
        """
        model = self._with_tables(weights, device or torch.device(self.spec.sharding.device))
        return self._with_dense(model, weights.dense)

    def dense_model(self, dense: dict[str, torch.Tensor]) -> nn.Module:
        """The served model's dense layers (in the spec's precision) around tables that are never
        allocated: for reading the dense part's served weights."""
        return self._with_dense(self._quant_model(torch.device("cpu")), dense)

    def lookups(self, weights: InferenceWeights) -> nn.Module:
        """Only the served model's sparse part (the architecture's ``split``): its tables, as in
        ``inference_model``; ``weights.dense`` is not needed."""
        model = self._with_tables(weights, torch.device(self.spec.sharding.device))
        sparse, _ = self.architecture.split(model)
        return sparse.eval()

    # -- helpers -------------------------------------------------------------------------------

    def _fused(self, maps: dict[str, SlotMap]) -> dict[str, SlotMap]:
        """Slot maps laid out as the served model's remaps search them (``raw_ids.fused_in``)."""
        return raw_ids.fused_in(self._quant_model(torch.device("cpu")), maps) if maps else maps

    def _with_dense(self, model: nn.Module, dense: dict[str, torch.Tensor]) -> nn.Module:
        missing, unexpected = model.load_state_dict(dense, strict=False)
        tables = table_prefixes(model)
        dense_missing = [k for k in missing if not k.startswith(tables)]
        if dense_missing or unexpected:
            raise CheckpointError(
                f"inference weights do not match the spec: missing {dense_missing}, "
                f"unexpected {unexpected}"
            )
        return apply_dense_precision(model, self.spec).eval()

    def _build(self, table_device: torch.device, device: torch.device) -> nn.Module:
        """The architecture's model: its embedding modules on ``table_device``, the rest on ``device``."""
        model = self.architecture.build(self.spec, EmbeddingTables(self.spec, table_device), device)
        check_forward(self.architecture, self.spec, model)
        check_collections(find_collections(model), self.spec)
        return model

    def _with_tables(self, weights: InferenceWeights, device: torch.device) -> nn.Module:
        """The model with its served tables filled in (zero-copy where possible), dense layers not
        loaded yet."""
        model = self._quant_model(device)
        raw_ids.load_slot_maps(model, weights.slot_maps)
        zero_copy = weights.buffers is not None and device.type == "cpu" and not self.spec.is_sharded
        if zero_copy:
            self._attach_all(model, weights.buffers)  # type: ignore[arg-type]
            return model
        if self.spec.is_sharded:
            model = shard(model, self.spec)  # the sharded modules allocate their own weights
        else:
            for module in tbe.tbes(model):
                tbe.allocate(module)
        tbe.refresh_table_views(model)
        self._copy_rows(model, weights.tables)
        return model

    def _quant_model(self, device: torch.device) -> nn.Module:
        """The model with quantized tables whose weight buffers are not allocated yet."""
        # The float collections only give the model its shapes; on ``meta`` they allocate nothing.
        model = self._build(torch.device("meta"), device)
        by_name = {t.name: t for t in self.spec.tables}  # each TBE keeps its own copy of these
        remappings = {name: pruning.remapping(ids, by_name[name]) for name, ids in self.kept.items()}
        quantize_in_place(model, self.spec, device, remappings)
        return model

    def _attach_all(self, model: nn.Module, buffers: list[torch.Tensor]) -> None:
        modules = tbe.tbes(model)
        if len(modules) != len(buffers):
            raise CheckpointError(
                f"inference weights hold {len(buffers)} TBE buffers, the spec needs {len(modules)}"
            )
        for module, buffer in zip(modules, buffers):
            try:
                tbe.attach(module, buffer)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        tbe.refresh_table_views(model)

    def _zeroed_buffers(self, model: nn.Module) -> list[torch.Tensor]:
        """Fresh zeroed buffers attached to the model's TBEs (padding stays 0: files reproduce)."""
        buffers = [torch.zeros(m.host_size, dtype=torch.uint8) for m in tbe.tbes(model)]
        self._attach_all(model, buffers)
        return buffers

    def _copy_rows(self, model: nn.Module, tables: dict[str, TableRows]) -> None:
        shards = [
            (name, rows, destination)
            for module in tbe.tbes(model)
            for (name, rows, *_), destination in zip(
                module.embedding_specs, module.split_embedding_weights()
            )
        ]
        copy_table_rows(shards, tables, {t.name: t.served_rows for t in self.spec.tables})


def _table_views(model: nn.Module) -> dict[str, TableRows]:
    return {
        name: (rows, scale_bias)
        for module in tbe.tbes(model)
        for (name, *_), (rows, scale_bias) in zip(
            module.embedding_specs, module.split_embedding_weights()
        )
    }


def _dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    tables = table_prefixes(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith(tables)}
