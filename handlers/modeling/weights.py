"""The served model's weights: quantized table rows in FBGEMM's layout plus the dense parameters,
and ``weights.pt``, the file that holds them.

``weights.pt`` is ``{"tbe.0": uint8 [host size], ..., "dense.<param>": tensor, ...,
"slot_maps.<table>.<part>": int64 [rows]}``: one flat buffer per table-batched
module, exactly as FBGEMM lays it out in memory, so a worker memory-maps the file and runs its
tables in place (page cache shared by every worker, no anonymous copy); and each raw-id table's
slot map, which workers map and use in place too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from handlers.modeling.errors import CheckpointError
from handlers.runtime.slot_maps import SlotMap, part_names, slot_maps_in

from fbgemm_gpu.split_embedding_configs import SparseType  # isort: skip

TableRows = tuple[torch.Tensor, "torch.Tensor | None"]


@dataclasses.dataclass
class InferenceWeights:
    """Everything the served model needs, in its served dtypes.

    ``tables[name] = (rows, scale_bias)``: the TBE rows ``[R, packed bytes or dim]`` and, for
    int8/int4/int2, the fp16 scale and bias per row as bytes ``[R, 4]`` (``None`` for fp32/fp16 tables).
    ``dense``: the float parameters of everything but the tables.
    ``buffers``: when the tables are views into FBGEMM's flat weight buffers (one per TBE, as saved
    in ``weights.pt``), those buffers; an unsharded CPU model then runs on them without a copy.
    ``slot_maps[name]``: a raw-id table's slot map (``handlers.modeling.raw_ids``).
    """

    tables: dict[str, TableRows]
    dense: dict[str, torch.Tensor]
    buffers: list[torch.Tensor] | None = None
    slot_maps: dict[str, SlotMap] = dataclasses.field(default_factory=dict)


def save_weights_file(
    buffers: list[torch.Tensor], dense: dict[str, torch.Tensor], path: Path, slot_maps: dict[str, SlotMap]
) -> None:
    flat = {f"tbe.{i}": b for i, b in enumerate(buffers)}
    flat.update({f"dense.{k}": v for k, v in dense.items()})
    for table, parts in slot_maps.items():
        flat.update({f"slot_maps.{table}.{name}": part for name, part in zip(part_names(parts), parts)})
    torch.save(flat, path)


def load_weights_file(
    path: Path, num_buffers: int
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, SlotMap]]:
    """Memory-maps ``weights.pt``: (the TBE buffers, the dense state, the slot maps)."""
    flat = torch.load(path, mmap=True, weights_only=True)
    buffers = [flat.get(f"tbe.{i}") for i in range(num_buffers)]
    if any(b is None for b in buffers) or f"tbe.{num_buffers}" in flat:
        stored = sorted(k for k in flat if k.startswith("tbe."))
        raise CheckpointError(f"{path}: holds {stored}, the spec needs {num_buffers} TBE buffers")
    dense = {k[len("dense.") :]: v for k, v in flat.items() if k.startswith("dense.")}
    return buffers, dense, slot_maps_in(flat)  # type: ignore[return-value]


def fill_random_table(
    values: torch.Tensor,
    scale_bias: torch.Tensor | None,
    sparse_type: SparseType,
    generator: torch.Generator,
) -> None:
    """Random rows of one table, dequantizing to uniform [-a, a] with a = 1/sqrt(rows).

    ``values``: uint8 [R, row bytes]; ``scale_bias``: uint8 [R, 4] (fp16 scale, then fp16 bias)
    for int8/int4/int2, None for fp16/fp32. Filled in chunks of 1M rows to bound temporary memory.
    """
    rows = values.shape[0]
    bound = rows**-0.5
    chunk = 1 << 20
    for start in range(0, rows, chunk):
        part = values[start : min(rows, start + chunk)]
        if scale_bias is None:  # fp16 / fp32 rows hold the values themselves
            floats = part.view(torch.float16 if sparse_type == SparseType.FP16 else torch.float32)
            floats.copy_(torch.rand(floats.shape, generator=generator) * 2 * bound - bound)
        else:  # int8: one value per byte, int4 two, int2 four: all uniform in random bytes
            part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, generator=generator))
    if scale_bias is not None:
        levels = {SparseType.INT8: 255, SparseType.INT4: 15, SparseType.INT2: 3}[sparse_type]
        params = scale_bias.view(torch.float16)  # [R, 2]
        params[:, 0] = 2 * bound / levels
        params[:, 1] = -bound


def copy_table_rows(
    shards: list[tuple[str, int, TableRows]],
    tables: dict[str, TableRows],
    table_rows: dict[str, int],
) -> None:
    """Copies each table's rows into the shards that hold them: ``shards`` lists (table, shard
    rows, destination rows and scale/bias) in rank order, with ascending row offsets per table
    (TorchRec lays out row-wise shards that way), so each shard takes the table's next rows."""
    if set(tables) != set(table_rows):
        raise CheckpointError(
            f"inference weights hold tables {sorted(tables)}, the spec has {sorted(table_rows)}"
        )
    next_row = dict.fromkeys(table_rows, 0)
    for name, shard_rows, (dst_rows, dst_scale_bias) in shards:
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
