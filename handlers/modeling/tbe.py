"""Every touch of FBGEMM's table-batched embedding (TBE) modules that their public API does not
offer, in one place. ``tests/handlers/modeling/test_library_contracts.py`` fails loudly when
FBGEMM or TorchRec change what these rely on.

Why each exists:

* ``deferred_tbe_weights``: TorchRec's quantized EmbeddingBagCollection builds each TBE and at once
  zero-fills its whole weight buffer (``initialize_weights``); there is no argument to skip it.
  For tables that come from a memory-mapped file that is a wasted second copy (6 GiB for Criteo
  1TB), so within this block the fill makes ``meta`` tensors instead.
* ``attach``: FBGEMM can only copy rows into its own buffer (``assign_embedding_weights``); to
  run on a memory-mapped file without a copy, the TBE's host buffer is replaced by the mapping.
* ``skip_bounds_checks``: the bounds-check mode is a constructor argument TorchRec does not pass
  through; the decoder has already checked every id, and the check's data-dependent guards stop
  AOTInductor.
* ``name_table_buffers``: a TBE keeps its weights as plain attributes, which ``torch.export``
  lifts as anonymous constants; registered as buffers they keep stable names.
* ``managed_collision_parts``, ``mch_slot_owners``, ``zch_identities``, ``ZCH_TRAINING_STATE``:
  TorchRec's managed-collision EBC keeps its EBC and its remap modules as private attributes, an
  MCH module which raw id owns each slot only as two private buffers (its sorted raw ids, and
  each one's slot), and a ZCH module as one (``_hash_zch_identities``); there is no public
  reader. A ZCH module's inference mode drops the training's metadata from a checkpoint only
  when loaded as the root module.
* ``zch_slots``: FBGEMM's ``zero_collision_hash`` operator, the ZCH lookup TorchRec calls, whose
  signature carries deprecated and training-only arguments: called here in its read-only form.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Iterator, Mapping

import torch
from torch import nn

from handlers.runtime import fbgemm_ops  # noqa: F401  the TBE operators
from handlers.runtime.inputs import MCH_FREE_SLOT
from handlers.runtime.quiet import quieter
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode  # isort: skip
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (  # isort: skip
    IntNBitTableBatchedEmbeddingBagsCodegen as TBE,
)
from torchrec.quant.embedding_modules import (  # isort: skip
    EmbeddingBagCollection as QuantEmbeddingBagCollection,
    EmbeddingCollection as QuantEmbeddingCollection,
)
from torchrec import EmbeddingBagCollection  # isort: skip
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection  # isort: skip
from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule  # isort: skip
from torchrec.modules.mc_modules import ManagedCollisionModule, MCHManagedCollisionModule  # isort: skip
from torchrec.tensor_types import UInt2Tensor, UInt4Tensor  # isort: skip


# FBGEMM pads each TBE row (scale/bias + packed values) to this many bytes. TorchRec's default, 16,
# turns a 68-byte int8 row of dim 64 into 80 bytes; 4 keeps the rows packed and the kernels exact.
ROW_ALIGNMENT = 4

_DEFERRAL = threading.Lock()  # the class attribute below is process-wide while patched


@contextlib.contextmanager
def deferred_tbe_weights() -> Iterator[None]:
    """TBEs built inside this block get weight buffers on ``meta``: the right size, no memory.
    ``attach`` or ``allocate`` gives them real weights. FBGEMM is restored on exit."""

    def on_meta(tbe: TBE) -> None:
        tbe.weights_host = torch.empty(tbe.host_size, dtype=torch.uint8, device="meta")
        tbe.weights_dev = torch.empty(tbe.dev_size, dtype=torch.uint8, device="meta")
        tbe.weight_initialized = True

    # Each TBE also logs its feature gates (a line of ~10 flags) on the root logger as it is built.
    with _DEFERRAL, quieter(""):
        original = TBE.initialize_weights
        TBE.initialize_weights = on_meta
        try:
            yield
        finally:
            TBE.initialize_weights = original


def tbes(model: nn.Module) -> list[TBE]:
    """The model's TBE modules, in rank order (TorchRec registers them as submodules when asked
    with ``register_tbes``, as ``quantize_inference_model`` and the factory do)."""
    return [m for m in model.modules() if isinstance(m, TBE)]


def table_constant_names(model: nn.Module, prefix: str) -> tuple[str, ...]:
    """What ``torch.export`` names each of ``tbes(model)``'s table buffers (``name_table_buffers``),
    in the same order, with the module path ``prefix`` of ``model`` in the captured module."""
    return tuple(f"{prefix}{path}.weights_host" for path, m in model.named_modules() if isinstance(m, TBE))


def attach(tbe: TBE, buffer: torch.Tensor) -> None:
    """Makes ``buffer`` (flat uint8 in this TBE's layout) the TBE's host weights, uncopied."""
    if tbe.dev_size or tbe.uvm_size:
        raise ValueError("only CPU-resident TBE weights can be attached without a copy")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != tbe.host_size:
        raise ValueError(
            f"TBE buffer for tables {[s[0] for s in tbe.embedding_specs]} must be uint8 "
            f"[{tbe.host_size}], got {buffer.dtype} {list(buffer.shape)}"
        )
    tbe.weights_host = buffer
    tbe.initialize_logical_weights_placements_and_offsets()  # what FBGEMM's allocation also sets


def allocate(tbe: TBE) -> None:
    """Gives a deferred TBE its own zeroed weights on its device."""
    tbe.weight_initialized = False
    tbe.initialize_weights()


def _per_table_modules(model: nn.Module) -> Iterator[tuple[nn.Module, nn.ModuleDict]]:
    """Each quantized collection (EBC or EC) and the per-table modules that hold its ``weight`` views."""
    for module in model.modules():
        if isinstance(module, QuantEmbeddingBagCollection):
            yield module, module.embedding_bags
        elif isinstance(module, QuantEmbeddingCollection):
            yield module, module.embeddings


def refresh_table_views(model: nn.Module) -> None:
    """Points each quantized collection's per-table ``weight`` buffers (what ``state_dict`` shows)
    at its TBEs' current weights; TorchRec registers them as views once, at construction."""
    for collection, per_table in _per_table_modules(model):
        for tbe in collection.tbes:
            views = tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)
            for (name, *_), (rows, *_) in zip(tbe.embedding_specs, views):
                table = per_table[name]
                wrapper = next((w for w in (UInt4Tensor, UInt2Tensor) if isinstance(table.weight, w)), None)
                table.weight = wrapper(rows) if wrapper is not None else rows


def set_index_remappings(module: TBE, remappings: Mapping[str, torch.Tensor]) -> None:
    """Pruned tables of ``module``: each id looks up the row ``remappings[table][id]`` (-1: none);
    a table without one keeps its ids as rows. FBGEMM's own setter lays the remappings out per
    table, but its lookup reads them per feature: a table with two features needs its remapping
    twice, so the buffers are laid out here, one region per feature (none: ids pass through)."""
    names = [spec[0] for spec in module.embedding_specs]
    if not any(name in remappings for name in names):
        return
    per_feature = [remappings.get(names[t]) for t in module.feature_table_map]
    sizes = [0 if remap is None else len(remap) for remap in per_feature]
    device = module.current_device
    module.index_remappings_array = torch.cat([r for r in per_feature if r is not None]).to(device, module.indices_dtype)
    module.index_remappings_array_offsets = torch.tensor(
        [0, *itertools.accumulate(sizes)], dtype=torch.int64, device=device
    )
    rows = [spec[1] for spec in module.embedding_specs]
    module.original_rows_per_table = torch.tensor(
        [size or rows[t] for size, t in zip(sizes, module.feature_table_map)], dtype=torch.int64, device=device
    )


def skip_bounds_checks(model: nn.Module) -> None:
    """No per-call id bounds check in the model's TBEs (the decoder has refused or hashed every
    id outside its table)."""
    for tbe in tbes(model):
        tbe.bounds_check_mode_int = BoundsCheckMode.NONE.value


def name_table_buffers(model: nn.Module) -> None:
    """Registers each TBE's tables (and their placement and offset arrays) as non-persistent
    buffers, so that export keeps their module names (a compiled package's weights are saved and
    loaded by them)."""
    for tbe in tbes(model):
        registered = dict(tbe.named_buffers(recurse=False))
        for name in ("weights_host", "weights_placements", "weights_offsets"):
            if name not in registered:
                tensor = getattr(tbe, name)
                delattr(tbe, name)
                tbe.register_buffer(name, tensor, persistent=False)


def drop_table_views(model: nn.Module) -> None:
    """Removes the quantized collections' per-table ``weight`` views (kept for ``state_dict``):
    exported as they are, the tables would be stored twice. The TBEs hold the real ones."""
    for _, per_table in _per_table_modules(model):
        for table in per_table.values():
            if "weight" in dict(table.named_buffers(recurse=False)):
                delattr(table, "weight")


def managed_collision_parts(
    module: ManagedCollisionEmbeddingBagCollection,
) -> tuple[EmbeddingBagCollection, dict[str, ManagedCollisionModule]]:
    """A managed-collision EBC's embedding bags, and its remap module (MCH or ZCH) per table."""
    remaps = module._managed_collision_collection._managed_collision_modules
    return module._embedding_module, dict(remaps.items())  # type: ignore[return-value]


def mch_slot_owners(module: MCHManagedCollisionModule) -> torch.Tensor:
    """The raw id that owns each of an MCH module's slots: int64 [zch_size], ``MCH_FREE_SLOT``
    where none does. MCH keeps its raw ids sorted, each beside its slot."""
    sorted_ids, slots = module._mch_sorted_raw_ids, module._mch_remapped_ids_mapping
    owners = torch.full_like(sorted_ids, MCH_FREE_SLOT)
    owners[slots - module._output_global_offset] = sorted_ids
    return owners



# a ZCH module's state that only training keeps (eviction metadata, id frequencies): a
# checkpoint of a GPU training holds it, the served (inference) module does not
ZCH_TRAINING_STATE = (HashZchManagedCollisionModule.METADATA_BUFFER, HashZchManagedCollisionModule.RUNTIME_META_BUFFER)


def zch_identities(module: HashZchManagedCollisionModule) -> torch.Tensor:
    """A ZCH module's identities, the raw id in each slot: int64 [zch_size] (a view),
    ``ZCH_EMPTY_SLOT`` where none is."""
    return module._hash_zch_identities.data[:, 0]


def zch_slots(
    ids: torch.Tensor, identities: torch.Tensor, max_probe: int,
    bucket_rows: torch.Tensor | None = None, bucket_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw ids int64 [V] -> slots int64 [V], as a ZCH module in eval finds them in ``identities``
    (int64 [rows]): probing from each id's hash at most ``max_probe`` slots, circularly within its
    bucket (``bucket_rows`` / ``bucket_starts``, int64 [V]: its bucket's size and first slot; None:
    one bucket, the table), and where no slot holds the id, the slot its probing started at."""
    # its meta kernel answers the input tensor itself as the slots: traced, the graph would take
    # the slots for the ids from there on, so the operator gets a copy of them
    slots, _ = torch.ops.fbgemm.zero_collision_hash(
        ids.clone(), identities.view(-1, 1), max_probe, circular_probe=True, readonly=True,
        local_sizes=bucket_rows, offsets=bucket_starts,
    )
    return slots
