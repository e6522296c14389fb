"""Raw-id tables (``ids: raw``): the float collection a model trains with TorchRec's managed
collisions, and the served one that maps raw ids to slots in the graph, exactly as TorchRec's
eval remap does.

A raw-id table's state, besides its rows, is which raw id owns each slot (row): its slot owners,
int64 [rows], ``MCH_FREE_SLOT`` where none does; kept as a slot map (``handlers.runtime.slot_maps``: the
owners sorted, and the slot of each), the form the remap searches, which workers map from the
weights file and use in place.

    float:   ManagedBags(tables)                 # KJT of raw ids -> KeyedTensor (trains, remaps)
    served:  RawIdBags(quantized_ebc, tables)    # the same, on the quantized tables
             served.load_slot_maps({"t_user": slot_map(owners)})
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from handlers.modeling.remap_spec import MchEviction, Unseen
from handlers.modeling.spec import TableSpec
from handlers.modeling.tbe import managed_collision_parts, mch_slot_owners
from handlers.runtime.inputs import MCH_FREE_SLOT
from handlers.runtime.slot_maps import SlotMap, slot_map

from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor  # isort: skip
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection  # isort: skip
from torchrec.modules.mc_modules import (  # isort: skip
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

_EVICTION = {
    MchEviction.LFU: LFU_EvictionPolicy,
    MchEviction.LRU: LRU_EvictionPolicy,
    MchEviction.DISTANCE_LFU: DistanceLFU_EvictionPolicy,
}


class ManagedBags(nn.Module):
    """The float, trainable collection of raw-id tables: TorchRec's managed-collision EBC (one MCH
    module per table), answering a ``KeyedTensor`` as an ``EmbeddingBagCollection`` does. Its
    state-dict names are those of TorchRec's ``McEmbeddingBagCollectionAdapter``, so a model
    trained with that adapter loads as it is. A table with ``unseen: zero`` has its default row
    (the last slot, where MCH maps unseen ids) held at zero: zeroed on load and before each
    forward, so every forward reads it as zero and a quantized copy is exactly zero (an optimizer
    step after the last forward may move it; loading the checkpoint zeroes it again)."""

    def __init__(self, ebc: EmbeddingBagCollection, tables: Sequence[TableSpec], device: torch.device) -> None:
        super().__init__()
        remaps = {}
        for table in tables:
            assert table.remap is not None, "ManagedBags holds raw-id tables only"
            remaps[table.name] = MCHManagedCollisionModule(
                zch_size=table.rows,
                device=device,
                eviction_policy=_EVICTION[table.remap.eviction](),
                eviction_interval=table.remap.eviction_interval,
            )
        configs = ebc.embedding_bag_configs()
        self.mc_embedding_bag_collection = ManagedCollisionEmbeddingBagCollection(
            ebc, ManagedCollisionCollection(remaps, configs), return_remapped_features=False
        )
        self._zero_unseen = [t.name for t in tables if t.remap.unseen == Unseen.ZERO]
        if self._zero_unseen:
            self.register_load_state_dict_post_hook(lambda module, _: module.zero_unseen_rows())
            self.zero_unseen_rows()

    @property
    def bags(self) -> EmbeddingBagCollection:
        return managed_collision_parts(self.mc_embedding_bag_collection)[0]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self.bags.embedding_bag_configs()

    def slot_owners(self) -> dict[str, torch.Tensor]:
        """Each table's slot owners, as its MCH module holds them now."""
        _, remaps = managed_collision_parts(self.mc_embedding_bag_collection)
        return {name: mch_slot_owners(module) for name, module in remaps.items()}

    def zero_unseen_rows(self) -> None:
        """The default rows of ``unseen: zero`` tables, zeroed."""
        with torch.no_grad():
            for name in self._zero_unseen:
                weight = self.bags.embedding_bags[name].weight
                if weight.device.type != "meta":
                    weight[-1].zero_()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self._zero_unseen:
            self.zero_unseen_rows()
        pooled, _ = self.mc_embedding_bag_collection(features)
        return pooled


class SlotRemap(nn.Module):
    """One table's raw id -> slot map, as TorchRec's MCH computes it in eval: a raw id that owns
    a slot gets it, any other the table's last slot (its default row). ``sorted_ids`` /
    ``slots``: the owners, sorted, and the slot of each. ``unseen`` / ``lookups``: the ids it
    found no owner for, and all it mapped, since load (counted in the graph, read by
    ``handlers.runtime.unseen_ids``)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.register_buffer("sorted_ids", torch.full((rows,), MCH_FREE_SLOT, dtype=torch.int64))
        self.register_buffer("slots", torch.arange(rows, dtype=torch.int64))
        for counter in ("unseen", "lookups"):
            self.register_buffer(counter, torch.zeros((), dtype=torch.int64), persistent=False)
        self.default_slot = rows - 1

    def load(self, slot_map: SlotMap) -> None:
        """Serves ``slot_map`` (used in place: a mapped file's pages stay shared)."""
        for name, tensor in zip(("sorted_ids", "slots"), slot_map):
            if tensor.shape != self.sorted_ids.shape or tensor.dtype != torch.int64:
                raise ValueError(
                    f"a slot map's {name} must be int64 [{self.sorted_ids.shape[0]}], got {tensor.dtype} {list(tensor.shape)}"
                )
        self.sorted_ids, self.slots = slot_map

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw ids int64 [V] -> slots int64 [V]."""
        found = torch.searchsorted(self.sorted_ids[:-1], ids)
        owned = self.sorted_ids[found] == ids
        self.unseen.add_(owned.numel() - owned.sum())
        self.lookups.add_(owned.numel())
        return torch.where(owned, self.slots[found], self.default_slot)


class RawIdBags(nn.Module):
    """The served collection of raw-id tables: each feature's raw ids through its table's
    ``SlotRemap``, then the quantized bags. ``raw_id_remaps`` are filled by
    ``load_slot_maps``."""

    def __init__(self, bags: nn.Module, tables: Sequence[TableSpec]) -> None:
        super().__init__()
        self.bags = bags
        self.raw_id_remaps = nn.ModuleDict({t.name: SlotRemap(t.rows) for t in tables})  # inputs.SLOT_MAPS
        self._table_of = {f: t.name for t in tables for f in t.features}

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self.bags.embedding_bag_configs()  # type: ignore[operator]

    def load_slot_maps(self, slot_maps: Mapping[str, SlotMap]) -> None:
        missing = sorted(set(self.raw_id_remaps) - set(slot_maps))
        if missing:
            raise ValueError(f"raw-id tables {missing} come without their slot maps")
        for name, remap in self.raw_id_remaps.items():
            remap.load(slot_maps[name])  # type: ignore[operator]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        keys = features.keys()
        per_feature = torch.split(features.values(), features.length_per_key())
        slots = [self.raw_id_remaps[self._table_of[key]](ids) for key, ids in zip(keys, per_feature)]
        remapped = KeyedJaggedTensor(
            keys=keys,
            values=torch.cat(slots),
            lengths=features.lengths(),
            weights=features.weights_or_none(),
            stride=features.stride(),
        )
        return self.bags(remapped)


def slot_owners(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every raw-id table's slot owners in a float model (none: ``{}``)."""
    return {
        name: owners
        for module in model.modules() if isinstance(module, ManagedBags)
        for name, owners in module.slot_owners().items()
    }


def slot_maps(model: nn.Module) -> dict[str, SlotMap]:
    """Every raw-id table's slot map in a float model (none: ``{}``)."""
    return {name: slot_map(owners) for name, owners in slot_owners(model).items()}


def load_slot_maps(model: nn.Module, maps: Mapping[str, SlotMap]) -> None:
    """Fills every ``RawIdBags`` of a served model with its tables' slot maps."""
    for module in model.modules():
        if isinstance(module, RawIdBags):
            module.load_slot_maps(maps)


def random_slot_map(rows: int, generator: torch.Generator) -> SlotMap:
    """Distinct random raw ids over the whole int64 range owning all slots but the last (left
    free, as training leaves it until the table is full), slot k to the k-th smallest: for models
    built without a checkpoint."""
    drawn = torch.randint(-(2**63), MCH_FREE_SLOT, (rows - 1,), generator=generator, dtype=torch.int64)
    # a repeat among 2^64 values is rare; each one found is drawn again
    while len(unique := torch.unique(drawn)) < len(drawn):
        extra = torch.randint(-(2**63), MCH_FREE_SLOT, (len(drawn) - len(unique),), generator=generator)
        drawn = torch.cat([unique, extra])
    return torch.cat([unique, torch.tensor([MCH_FREE_SLOT])]), torch.arange(rows, dtype=torch.int64)
