"""Raw-id tables (``ids: raw``): the float collection a model trains with TorchRec's managed
collisions, and the served one that maps raw ids to slots in the graph, exactly as TorchRec's
eval remap does.

A raw-id table's state, besides its rows, is which raw id owns each slot (row): its slot owners,
int64 [rows], ``MCH_FREE_SLOT`` where none does; kept as a slot map (``handlers.runtime.slot_maps``:
an MCH table's owners sorted with the slot of each, a ZCH table's identities), the form the remap
searches, which workers map from the weights file and use in place.

    float:   ManagedBags(tables)                 # KJT of raw ids -> KeyedTensor (remaps, MCH trains)
    served:  RawIdBags(quantized_ebc, tables)    # the same, on the quantized tables
             load_slot_maps(served, fused_in(served, slot_maps(float_model)))
"""

from __future__ import annotations

import functools
import warnings
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from handlers.modeling import tbe
from handlers.modeling.errors import CheckpointError
from handlers.modeling.remap_spec import MchEviction, RemapKind
from handlers.modeling.remaps import RawIdRemaps
from handlers.modeling.spec import TableSpec
from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT
from handlers.runtime.quiet import quieter
from handlers.runtime.slot_maps import SlotMap, fused, hash_map, owners_of, slot_map

from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor  # isort: skip
from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule  # isort: skip
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
    """The float collection of raw-id tables: TorchRec's managed-collision EBC (one MCH or ZCH
    module per table), answering a ``KeyedTensor`` as an ``EmbeddingBagCollection`` does. MCH
    trains on CPU; ZCH's modules are built for inference (FBGEMM's CPU kernel only looks up: a
    ZCH table's slots come from a checkpoint trained on GPU, its metadata dropped on load). Its
    state-dict names are those of TorchRec's ``McEmbeddingBagCollectionAdapter``, so a model
    trained with that adapter loads as it is. An MCH table with ``unseen: zero`` has its default
    row (the last slot, where MCH maps unseen ids) held at zero: zeroed on load and before each
    forward, so every forward reads it as zero and a quantized copy is exactly zero (an optimizer
    step after the last forward may move it; loading the checkpoint zeroes it again). A ZCH table
    with ``unseen: zero`` reserves no slot: in eval its unseen ids are left out of their bags
    (``without_unseen``), as the served lookup leaves out their slot, -1."""

    def __init__(self, ebc: EmbeddingBagCollection, tables: Sequence[TableSpec], device: torch.device) -> None:
        super().__init__()
        remaps = {t.name: _remap_module(t, device) for t in tables}
        zch = [t for t in tables if t.remap.kind == RemapKind.ZCH]  # type: ignore[union-attr]
        self._hashed = {t.name: (t.remap.max_probe, t.remap.buckets) for t in zch}  # type: ignore[union-attr]
        configs = ebc.embedding_bag_configs()
        self.mc_embedding_bag_collection = ManagedCollisionEmbeddingBagCollection(
            ebc, ManagedCollisionCollection(remaps, configs), return_remapped_features=False
        )
        self._zero_unseen = [t.name for t in tables if t.remap.zero_row]  # type: ignore[union-attr]
        self._dropping_unseen = {t.name: t.features for t in zch if t.remap.drops_unseen}  # type: ignore[union-attr]
        if self._zero_unseen:
            self.register_load_state_dict_post_hook(lambda module, _: module.zero_unseen_rows())
            self.zero_unseen_rows()

    @property
    def bags(self) -> EmbeddingBagCollection:
        return tbe.managed_collision_parts(self.mc_embedding_bag_collection)[0]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self.bags.embedding_bag_configs()

    def slot_owners(self) -> dict[str, torch.Tensor]:
        """Each table's slot owners, as its remap module holds them now."""
        _, remaps = tbe.managed_collision_parts(self.mc_embedding_bag_collection)
        owners = {}
        for name, module in remaps.items():
            if name not in self._hashed:
                owners[name] = tbe.mch_slot_owners(module)
                continue
            identities = tbe.zch_identities(module)
            marked = torch.nonzero(identities == MCH_FREE_SLOT).flatten()
            if len(marked):  # owners (and deltas' records) mark free slots with it
                raise CheckpointError(f"{name}: raw id {MCH_FREE_SLOT} owns slot {int(marked[0])}; that id is "
                                      "not served (it marks free slots), a zch table's other ids are")
            _check_probing(name, identities, *self._hashed[name])
            owners[name] = owners_of((identities,))
        return owners

    def slot_maps(self) -> dict[str, SlotMap]:
        """Each table's slot map, in the form its served remap searches."""
        return {
            name: hash_map(owners) if name in self._hashed else slot_map(owners)
            for name, owners in self.slot_owners().items()
        }

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
        if self._dropping_unseen and not self.training:  # a training inserts them
            features = self.without_unseen(features)
        pooled, _ = self.mc_embedding_bag_collection(features)
        return pooled

    def without_unseen(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` with every id of a ZCH table with ``unseen: zero`` that owns no slot left
        out of its bag (its weight too): what the served remap's -1 slot does in FBGEMM's lookup."""
        _, remaps = tbe.managed_collision_parts(self.mc_embedding_bag_collection)
        keys, lengths, values = features.keys(), features.lengths(), features.values()
        key_of = torch.repeat_interleave(torch.arange(len(keys)), lengths.view(len(keys), -1).sum(1))
        keep = torch.ones_like(values, dtype=torch.bool)
        for table, table_features in self._dropping_unseen.items():
            mine = torch.isin(key_of, torch.tensor([keys.index(f) for f in table_features if f in keys]))
            ids, identities = values[mine], tbe.zch_identities(remaps[table])
            keep[mine] = identities[zch_lookup(ids, identities, *self._hashed[table])] == ids
        bag_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        weights = features.weights_or_none()
        return KeyedJaggedTensor(
            keys=keys,
            values=values[keep],
            lengths=torch.bincount(bag_of[keep], minlength=lengths.numel()).to(lengths.dtype),
            weights=None if weights is None else weights[keep],
            stride=features.stride(),
        )


class RawIdBags(nn.Module):
    """The served collection of raw-id tables: every feature's raw ids through the tables' remap
    (``remaps.RawIdRemaps``, MCH and ZCH), then the quantized bags. ``counted``: the model's raw-id
    tables, whose unseen ids the remap counts. The remap's slot maps are filled by ``load_slot_maps``."""

    def __init__(self, bags: nn.Module, tables: Sequence[TableSpec], counted: Sequence[str] | None = None) -> None:
        super().__init__()
        self.bags = bags
        self.raw_id_remaps = RawIdRemaps(tables, counted)  # inputs.SLOT_MAPS

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self.bags.embedding_bag_configs()  # type: ignore[operator]

    def load_slot_maps(self, slot_maps: Mapping[str, SlotMap]) -> None:
        missing = sorted(set(self.raw_id_remaps.ranges) - set(slot_maps))
        if missing:
            raise ValueError(f"raw-id tables {missing} come without their slot maps")
        self.raw_id_remaps.load(slot_maps)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        order = self.raw_id_remaps.features
        if features.keys() != order:
            features = features.permute([features.keys().index(f) for f in order])
        per_feature = features.lengths().view(len(order), -1).sum(1)
        remapped = KeyedJaggedTensor(
            keys=order,
            values=self.raw_id_remaps(features.values(), per_feature),
            lengths=features.lengths(),
            weights=features.weights_or_none(),
            stride=features.stride(),
        )
        return self.bags(remapped)


def torchrec_naming(model: nn.Module) -> dict[str, str]:
    """Prefix rules from the state names TorchRec's own ``ManagedCollisionEmbeddingBagCollection``
    has where the float model holds a ``ManagedBags`` to the model's (those of TorchRec's adapter,
    one level deeper), e.g. ``{"sparse_arch.embedding_bag_collection._embedding_module.":
    "sparse_arch.embedding_bag_collection.mc_embedding_bag_collection._embedding_module.", ...}``."""
    rules = {}
    for path, module in model.named_modules():
        if isinstance(module, ManagedBags):
            at = f"{path}." if path else ""
            for child, _ in module.mc_embedding_bag_collection.named_children():
                rules[f"{at}{child}."] = f"{at}mc_embedding_bag_collection.{child}."
    return rules


@functools.cache
def mch_eviction_state() -> dict[MchEviction, frozenset[str]]:
    """The state an MCH table keeps for its eviction policy alone (the names' last part), per
    policy: ``lfu``: ``_mch_counts``, ``lru``: ``_mch_last_access_iter``, ``distance_lfu``: both."""
    cpu = torch.device("cpu")
    names = {
        eviction: frozenset(MCHManagedCollisionModule(2, cpu, policy(), eviction_interval=1).state_dict())
        for eviction, policy in _EVICTION.items()
    }
    shared = frozenset.intersection(*names.values())
    return {eviction: state - shared for eviction, state in names.items()}


def slot_owners(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every raw-id table's slot owners in a float model (none: ``{}``)."""
    return {
        name: owners
        for module in model.modules() if isinstance(module, ManagedBags)
        for name, owners in module.slot_owners().items()
    }


def slot_maps(model: nn.Module) -> dict[str, SlotMap]:
    """Every raw-id table's slot map in a float model (none: ``{}``)."""
    return {
        name: served
        for module in model.modules() if isinstance(module, ManagedBags)
        for name, served in module.slot_maps().items()
    }


def load_slot_maps(model: nn.Module, maps: Mapping[str, SlotMap]) -> None:
    """Fills every ``RawIdBags`` of a served model with its tables' slot maps (``fused_in``)."""
    for module in model.modules():
        if isinstance(module, RawIdBags):
            module.load_slot_maps(maps)


def served_slot_maps(model: nn.Module) -> dict[str, SlotMap]:
    """Every raw-id table's slot map in a served model: views of what it serves."""
    return {
        name: served
        for module in model.modules() if isinstance(module, RawIdBags)
        for name, served in module.raw_id_remaps.table_maps().items()
    }


def fused_in(model: nn.Module, maps: dict[str, SlotMap]) -> dict[str, SlotMap]:
    """``maps`` laid out (in place) as ``model``'s raw-id collections serve them
    (``slot_maps.fused``): each collection's tables of a kind end to end."""
    collections = [module for module in model.modules() if isinstance(module, RawIdBags)]
    return fused(maps, [name for module in collections for name in module.raw_id_remaps.ranges])


def random_slot_map(table: TableSpec, generator: torch.Generator) -> SlotMap:
    """A slot map of distinct random raw ids over the whole int64 range, for models built without
    a checkpoint. MCH: every slot but the last owned (left free, as training leaves it until the
    table is full), slot k by the k-th smallest id; ZCH: as many ids as slots inserted by
    ``zch_insert`` (those whose probing finds no free slot left out)."""
    rows = table.rows
    drawn = torch.randint(-(2**63), MCH_FREE_SLOT, (rows - 1,), generator=generator, dtype=torch.int64)
    # a repeat among 2^64 values is rare; each one found is drawn again
    while len(unique := torch.unique(drawn)) < len(drawn):
        extra = torch.randint(-(2**63), MCH_FREE_SLOT, (len(drawn) - len(unique),), generator=generator)
        drawn = torch.cat([unique, extra])
    if table.remap.kind == RemapKind.ZCH:  # type: ignore[union-attr]
        identities = torch.full((rows,), ZCH_EMPTY_SLOT, dtype=torch.int64)
        remap = table.remap
        zch_insert(identities, unique[unique != ZCH_EMPTY_SLOT], remap.max_probe, remap.buckets)  # type: ignore[union-attr]
        return (identities,)
    return torch.cat([unique, torch.tensor([MCH_FREE_SLOT])]), torch.arange(rows, dtype=torch.int64)


def zch_insert(identities: torch.Tensor, ids: torch.Tensor, max_probe: int, buckets: int) -> int:
    """Inserts raw ``ids`` (int64 [n], distinct) into a ZCH table's ``identities`` (int64 [rows],
    changed in place) as its training's probing does: each id not in the table takes the first
    free slot of its probe sequence, probe step by probe step (at each step an earlier id before a
    later one on a slot both reach then); an id that finds none within ``max_probe`` slots is left
    out. Returns how many ids are in the table after."""
    ids = ids[~torch.isin(ids, identities)]
    bucket_rows = len(identities) // buckets
    starts = torch.remainder(ids, buckets) * bucket_rows
    first = first_probe_slots(ids, len(identities), buckets) - starts
    pending = torch.arange(len(ids))
    for step in range(max_probe):
        if not len(pending):
            break
        slots = starts[pending] + torch.remainder(first[pending] + step, bucket_rows)
        free = torch.nonzero(identities[slots] == ZCH_EMPTY_SLOT).flatten()
        claimed, earliest = np.unique(slots[free].numpy(), return_index=True)  # the earliest id claims a slot
        winners = free[torch.from_numpy(earliest)]
        identities[torch.from_numpy(claimed)] = ids[pending[winners]]
        placed = torch.zeros(len(pending), dtype=torch.bool)
        placed[winners] = True
        pending = pending[~placed]
    return int((identities != ZCH_EMPTY_SLOT).sum())


def zch_lookup(ids: torch.Tensor, identities: torch.Tensor, max_probe: int, buckets: int) -> torch.Tensor:
    """Raw ids int64 [V] -> their slots in a ZCH table's ``identities`` (int64 [rows])."""
    if buckets == 1:
        return tbe.zch_slots(ids, identities, max_probe)
    bucket_rows = len(identities) // buckets  # as TorchRec's TrainInputMapper: bucket id mod buckets
    starts = torch.remainder(ids, buckets) * bucket_rows
    return tbe.zch_slots(ids, identities, max_probe, torch.full_like(ids, bucket_rows), starts)


def first_probe_slots(ids: torch.Tensor, rows: int, buckets: int) -> torch.Tensor:
    """The slot each raw id's ZCH probing starts at, int64 [n], in a table of ``rows`` slots."""
    empty = torch.full((rows,), ZCH_EMPTY_SLOT, dtype=torch.int64)  # on an empty table the lookup answers it
    return zch_lookup(ids, empty, 1, buckets)


def _check_probing(table: str, identities: torch.Tensor, max_probe: int, buckets: int) -> None:
    """Raises ``CheckpointError`` unless the lookup finds every id of a ZCH table's identities
    where they are: the spec's max_probe and buckets are the training's."""
    slots = torch.nonzero(identities != ZCH_EMPTY_SLOT).flatten()
    lost = torch.nonzero(zch_lookup(identities[slots], identities, max_probe, buckets) != slots).flatten()
    if len(lost):
        first = int(slots[lost[0]])
        raise CheckpointError(
            f"{table}: {len(lost)} of its {len(slots)} raw ids are not where probing at most {max_probe} slots "
            f"in {buckets} bucket(s) finds them (raw id {int(identities[first])} in slot {first}): the spec's "
            "remap.max_probe and remap.buckets must be the training's"
        )


def _remap_module(table: TableSpec, device: torch.device) -> nn.Module:
    """TorchRec's remap module for a raw-id table of a float model."""
    remap = table.remap
    assert remap is not None, "ManagedBags holds raw-id tables only"
    if remap.kind == RemapKind.ZCH:
        with quieter("torchrec"), warnings.catch_warnings():  # it logs its settings; warns of a tensor copy
            warnings.simplefilter("ignore", UserWarning)
            return HashZchManagedCollisionModule(
                zch_size=table.rows, device=device, total_num_buckets=remap.buckets, max_probe=remap.max_probe,
                is_inference=True,
            )
    return MCHManagedCollisionModule(
        zch_size=table.rows,
        device=device,
        eviction_policy=_EVICTION[remap.eviction](),
        eviction_interval=remap.eviction_interval,
    )


def served_remap(table: TableSpec) -> RawIdRemaps:
    """One raw-id table's served remap; ``load({table.name: slot_map})`` gives it its slot map,
    and ``first_feature(ids)`` maps ids."""
    return RawIdRemaps([table])
