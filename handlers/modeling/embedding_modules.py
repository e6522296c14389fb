"""The model's embedding modules, wherever the architecture put them: made from the spec's tables,
found by walking the model, checked against the spec, and swapped for TorchRec's quantized ones.

An architecture makes its collections with ``EmbeddingTables`` (or TorchRec's constructors on
``tables.device``), at any path and as many as it likes:

    def build(self, spec, tables, device):
        return MyModel(
            user_bags=tables.bags("t_user", "t_geo"),   # EmbeddingBagCollection: pooled (sum/mean)
            items=tables.sequences("t_item"),           # EmbeddingCollection: unpooled (pooling: none)
            device=device,
        )

The factory then finds every ``EmbeddingBagCollection`` and ``EmbeddingCollection``
(``find_collections``), checks that together they hold each spec table once with its shape, and
replaces each by its quantized counterpart with the spec's per-table dtypes (``quantize_in_place``).
Modules the project cannot serve are refused by path and type.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import torch
from torch import nn

from handlers.modeling import tbe
from handlers.modeling.errors import SpecError
from handlers.modeling.raw_ids import ManagedBags, RawIdBags
from handlers.modeling.remap_spec import IdSpace
from handlers.modeling.spec import ModelSpec, Pooling, TableSpec, WeightDtype

from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig  # isort: skip
from torchrec.modules.embedding_configs import DataType, PoolingType  # isort: skip
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection  # isort: skip
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection  # isort: skip
from torchrec.distributed.quant_embedding import ShardedQuantEmbeddingCollection  # isort: skip
from torchrec.distributed.quant_embeddingbag import ShardedQuantEmbeddingBagCollection  # isort: skip
from torchrec.quant.embedding_modules import (  # isort: skip
    EmbeddingBagCollection as QuantEmbeddingBagCollection,
    EmbeddingCollection as QuantEmbeddingCollection,
)

_TORCHREC_DTYPE = {
    WeightDtype.FP32: DataType.FP32,
    WeightDtype.FP16: DataType.FP16,
    WeightDtype.INT8: DataType.INT8,
    WeightDtype.INT4: DataType.INT4,
    WeightDtype.INT2: DataType.INT2,
}
_POOLING = {Pooling.SUM: PoolingType.SUM, Pooling.MEAN: PoolingType.MEAN}

# What the project cannot serve yet, and why (refused at build by path and type).
_UNSERVABLE: dict[type, str] = {
    FeatureProcessedEmbeddingBagCollection: "feature processors are not served",
    BaseManagedCollisionEmbeddingCollection: "managed collisions are served for tables with ids: raw, in the collection EmbeddingTables.bags makes of them",
}


class EmbeddingTables:
    """The spec's tables as TorchRec's float embedding modules on ``device`` (``meta`` where the
    factory needs only their shapes). ``bags``: pooled tables (``pooling: sum | mean``) in an
    ``EmbeddingBagCollection``; ``sequences``: unpooled ones (``pooling: none``) in an
    ``EmbeddingCollection``. Without names, every table of that kind."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device

    def bags(self, *names: str) -> EmbeddingBagCollection | ManagedBags:
        """Raw-id tables (``ids: raw``) come in TorchRec's managed-collision collection, which
        remaps every table it holds: a collection's tables are all raw, or none."""
        tables = self._tables(names, pooled=True)
        ebc = EmbeddingBagCollection(
            tables=bag_configs(tables), is_weighted=self.spec.weighted_ids, device=self.device
        )
        raw = [t.name for t in tables if t.ids == IdSpace.RAW]
        if not raw:
            return ebc
        if len(raw) < len(tables):
            index = [t.name for t in tables if t.ids != IdSpace.RAW]
            raise SpecError(
                f"tables: {raw} (ids raw) and {index} (ids index) are asked for in one collection; managed "
                "collisions remap every table of theirs: give them all ids raw (DLRM asks for all its tables "
                "in one collection), or, in an architecture of your own, ask for the raw-id tables apart"
            )
        return ManagedBags(ebc, tables, self.device)

    def sequences(self, *names: str) -> EmbeddingCollection:
        return EmbeddingCollection(tables=sequence_configs(self._tables(names, pooled=False)), device=self.device)

    def _tables(self, names: tuple[str, ...], pooled: bool) -> list[TableSpec]:
        by_name = {t.name: t for t in self.spec.tables}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SpecError(f"tables: the architecture asks for {unknown}, the spec has {sorted(by_name)}")
        chosen = [by_name[n] for n in names] if names else [
            t for t in self.spec.tables if (t.pooling != Pooling.NONE) == pooled
        ]
        wrong = [t.name for t in chosen if (t.pooling != Pooling.NONE) != pooled]
        if wrong:
            kind = "pooled (bags)" if pooled else "unpooled (sequences, pooling: none)"
            raise SpecError(f"tables: {wrong} asked for as {kind} tables; their spec pooling says otherwise")
        return chosen


def bag_configs(tables: Iterable[TableSpec], with_dtypes: bool = False) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(**_config(t, with_dtypes), pooling=_POOLING[t.pooling]) for t in tables]


def sequence_configs(tables: Iterable[TableSpec], with_dtypes: bool = False) -> list[EmbeddingConfig]:
    return [EmbeddingConfig(**_config(t, with_dtypes)) for t in tables]


def _config(table: TableSpec, with_dtypes: bool) -> dict:
    """What TorchRec's two table configs share: the float model's are fp32, the served ones
    carry the spec's dtype and, pruned, the rows they keep."""
    served = {"data_type": _TORCHREC_DTYPE[table.weight_dtype], "num_embeddings_post_pruning": table.pruned_to}
    return {
        "name": table.name,
        "num_embeddings": table.rows,
        "embedding_dim": table.dim,
        "feature_names": list(table.features),
        **(served if with_dtypes else {"data_type": DataType.FP32}),
    }


@dataclasses.dataclass(frozen=True)
class Collection:
    """One embedding module of a model: its path, and the names of its tables."""

    path: str
    module: nn.Module  # the embedding collection itself (a raw-id collection's bags)
    tables: tuple[str, ...]
    raw_ids: bool = False  # a ManagedBags (float) or RawIdBags (served) at ``path``

    @property
    def pooled(self) -> bool:
        return isinstance(self.module, (EmbeddingBagCollection, QuantEmbeddingBagCollection))


def find_collections(model: nn.Module) -> list[Collection]:
    """Every float or quantized embedding collection of ``model``, in module order; raises
    ``SpecError`` naming the path and type of one the project cannot serve."""
    found: list[Collection] = []
    raw_paths: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(f"{raw}.") for raw in raw_paths):
            continue  # a raw-id collection's own parts
        if isinstance(module, (ManagedBags, RawIdBags)):
            names = tuple(c.name for c in module.bags.embedding_bag_configs())
            found.append(Collection(path, module.bags, names, raw_ids=True))
            raw_paths.append(path)
            continue
        for kind, why in _UNSERVABLE.items():
            if isinstance(module, kind):
                raise SpecError(f"{path or 'model'}: {type(module).__name__}: {why}")
        if isinstance(module, (EmbeddingBagCollection, QuantEmbeddingBagCollection)):
            names = tuple(c.name for c in module.embedding_bag_configs())
        elif isinstance(module, (EmbeddingCollection, QuantEmbeddingCollection)):
            names = tuple(c.name for c in module.embedding_configs())
        else:
            continue
        found.append(Collection(path, module, names))
    return found


def check_collections(collections: list[Collection], spec: ModelSpec) -> None:
    """The model's collections hold every spec table exactly once, with its rows, dim, pooling and
    features; raises ``SpecError`` naming the first table (or module) that does not."""
    if not collections:
        raise SpecError("architecture: its model holds no EmbeddingBagCollection or EmbeddingCollection")
    by_name = {t.name: t for t in spec.tables}
    seen: dict[str, str] = {}
    for collection in collections:
        configs = (
            collection.module.embedding_bag_configs() if collection.pooled else collection.module.embedding_configs()
        )
        for config in configs:
            where = f"{collection.path}: table {config.name}"
            if config.name in seen:
                raise SpecError(f"{where}: also in {seen[config.name]}; a table lives in one collection")
            seen[config.name] = collection.path
            table = by_name.get(config.name)
            if table is None:
                raise SpecError(f"{where}: not in the spec's tables ({', '.join(by_name)})")
            if (config.num_embeddings, config.embedding_dim) != (table.rows, table.dim):
                raise SpecError(
                    f"{where}: {config.num_embeddings} rows x dim {config.embedding_dim}, the spec says "
                    f"{table.rows} x {table.dim}"
                )
            if collection.raw_ids != (table.ids == IdSpace.RAW):
                kind = "a managed-collision (raw id) collection" if collection.raw_ids else "a plain collection"
                raise SpecError(f"{where}: in {kind}, the spec's ids are {table.ids.value}")
            if tuple(config.feature_names) != table.features:
                raise SpecError(f"{where}: features {config.feature_names}, the spec says {list(table.features)}")
            if collection.pooled == (table.pooling == Pooling.NONE):
                kind = "EmbeddingBagCollection (pooled)" if collection.pooled else "EmbeddingCollection (unpooled)"
                raise SpecError(f"{where}: in an {kind}, the spec's pooling is {table.pooling.value}")
            if collection.pooled and config.pooling != _POOLING[table.pooling]:
                raise SpecError(f"{where}: pooling {config.pooling.name.lower()}, the spec says {table.pooling.value}")
        if collection.pooled and collection.module.is_weighted() != spec.weighted_ids:
            raise SpecError(
                f"{collection.path}: is_weighted={collection.module.is_weighted()}, the spec's weighted_ids is "
                f"{spec.weighted_ids}"
            )
    missing = [n for n in by_name if n not in seen]
    if missing:
        raise SpecError(f"tables: {missing} are in the spec but in none of the model's embedding collections")


def quantize_in_place(
    model: nn.Module, spec: ModelSpec, device: torch.device, remappings: Mapping[str, torch.Tensor] = {}
) -> list[Collection]:
    """Replaces each float collection of ``model`` by TorchRec's quantized one (FBGEMM TBEs in the
    spec's per-table dtypes, weights not allocated: ``tbe.deferred_tbe_weights``); a pruned table
    looks its ids up through its ``remappings`` entry (``pruning.remapping``). Returns the
    quantized collections."""
    floats = find_collections(model)  # checked against the spec as the factory built the model
    by_name = {t.name: t for t in spec.tables}
    quantized = []
    with tbe.deferred_tbe_weights():
        for collection in floats:
            tables = [by_name[n] for n in collection.tables]
            if collection.pooled:
                module: nn.Module = QuantEmbeddingBagCollection(
                    tables=bag_configs(tables, with_dtypes=True),
                    is_weighted=collection.module.is_weighted(),
                    device=device,
                    output_dtype=torch.float,
                    register_tbes=True,
                    row_alignment=tbe.ROW_ALIGNMENT,
                )
            else:
                module = QuantEmbeddingCollection(
                    tables=sequence_configs(tables, with_dtypes=True),
                    device=device,
                    output_dtype=torch.float,
                    register_tbes=True,
                    row_alignment=tbe.ROW_ALIGNMENT,
                )
            for table_batch in tbe.tbes(module):
                tbe.set_index_remappings(table_batch, remappings)
            served = RawIdBags(module, tables, sorted(spec.raw_id_tables)) if collection.raw_ids else module
            _replace(model, collection.path, served)
            quantized.append(Collection(collection.path, module, collection.tables, collection.raw_ids))
    return quantized


def table_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each table's float weight [rows, dim] in a float model, by table name, wherever it lies."""
    weights = {}
    for collection in find_collections(model):
        module = collection.module
        per_table = module.embedding_bags if collection.pooled else module.embeddings
        weights.update({name: per_table[name].weight for name in collection.tables})
    return weights


_SHARDED = (ShardedQuantEmbeddingBagCollection, ShardedQuantEmbeddingCollection)


def table_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The state-dict prefixes of the model's embedding collections (``path.``), sharded ones
    included: what is not dense."""
    sharded = [path for path, module in model.named_modules() if isinstance(module, _SHARDED)]
    return tuple(f"{path}." for path in [c.path for c in find_collections(model)] + sharded)


def without_tables(model: nn.Module) -> tuple[str, ...]:
    """Replaces the model's embedding collections with empty modules, for reading its dense
    weights alone (a managed-collision module's load hook would read its tables' state);
    returns their state-dict prefixes (``table_prefixes``)."""
    prefixes = table_prefixes(model)
    for collection in find_collections(model):
        _replace(model, collection.path, nn.Module())
    return prefixes


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    if not path:
        raise SpecError("architecture: the model is itself an embedding collection; wrap it in a module")
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)
