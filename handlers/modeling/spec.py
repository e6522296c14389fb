"""The model description shared by the factory, the archive tool, the handler and the tests.

A spec is YAML, parsed once into typed pydantic models (``handlers.modeling.registry.load_spec``
picks the architecture's spec type by its ``architecture`` key) and validated on construction;
every error names its key path, e.g. ``tables[2].dim: must equal bottom_mlp[-1] (64), got 32``.
``config/models/spec.schema.json`` is the JSON Schema of all spec types, for editors, and
``config/models/SPEC.md`` the reference generated from it.

This module holds what every architecture shares (tables, sharding, limits, dense precision,
checkpoint mapping); each architecture module adds its own keys by subclassing ``ModelSpec``.

Example (``config/models/tiny.yaml``)::

    name: tiny
    dense_features: 4
    bottom_mlp: [16, 8]
    top_mlp: [16, 1]
    tables:
      - {name: t_user, rows: 100, dim: 8, features: [user_id], weight_dtype: int8}
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import Field, StrictBool, StrictStr, model_validator
from torch import nn

from handlers.modeling.remap_spec import IdSpace, RemapSpec
from handlers.modeling.spec_sections import (  # noqa: F401  the spec's types, imported from here too
    IdsPerItem,
    LayerSizes,
    LimitsSpec,
    Name,
    PositiveInt,
    Section,
)
from handlers.runtime.inputs import OutOfRangePolicy

class DensePrecision(str, enum.Enum):
    """How one dense submodule (an MLP) runs in the served model: a float dtype, or TorchAO int8
    weights with float (weight-only) or per-call int8 (dynamic) activations."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8_WEIGHT_ONLY = "int8_weight_only"
    INT8_DYNAMIC = "int8_dynamic"


class Pooling(str, enum.Enum):
    """How a feature's ids reach the model: pooled into one row per bag (an
    ``EmbeddingBagCollection``), or unpooled, one row per id (``none``: a sequence, in an
    ``EmbeddingCollection``)."""

    SUM = "sum"
    MEAN = "mean"
    NONE = "none"


class WeightDtype(str, enum.Enum):
    """Storage dtype of one embedding table in the served model (FBGEMM TBE kernels)."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"

    @property
    def values_per_byte(self) -> int:
        """Values packed into one byte: int4 2, int2 4, otherwise 1 (or fewer)."""
        return {"int4": 2, "int2": 4}.get(self.value, 1)


class ShardingType(str, enum.Enum):
    """TorchRec inference sharding of one table; ``auto`` lets TorchRec's planner choose."""

    AUTO = "auto"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"


# TorchRec keeps a collection's tables in an nn.ModuleDict: a table may not take one of its names.
_MODULE_DICT_ATTRIBUTES = frozenset(n for n in dir(nn.ModuleDict) if not n.startswith("_"))


class TableSpec(Section):
    """One embedding table: its rows, width, the features that look it up, and how it is served."""

    name: Name = Field(description="unique table name (its checkpoint key)")
    rows: PositiveInt = Field(description="rows (ids 0..rows-1)")
    dim: PositiveInt = Field(description="embedding width")
    features: Annotated[tuple[Name, ...], Field(min_length=1)] = Field(
        description="sparse features looked up in this table"
    )
    pooling: Pooling = Field(
        Pooling.SUM, description="how a bag of ids becomes one row; none: a sequence, one row per id"
    )
    max_sequence_length: PositiveInt | None = Field(
        None,
        description="pooling none only: the most ids one sequence of its features holds (more is a "
        "400 naming the feature); default limits.max_ids_per_bag",
    )
    ids_per_item: IdsPerItem = Field(
        IdsPerItem(), description="ids in one bag of each of its features (per request for a history)"
    )
    ids_per_feature: dict[Name, IdsPerItem] = Field(
        {}, description="feature -> its ids per bag, where one of the table's features differs from ids_per_item"
    )
    weight_dtype: WeightDtype = Field(
        WeightDtype.INT8, description="served dtype (FBGEMM row-wise quantization for int8/int4/int2)"
    )
    pruned_to: PositiveInt | None = Field(
        None,
        description="serve only this many rows: those of the ids the spec's pruning file keeps for this "
        "table; every other id looks up a zero row",
    )
    ids: IdSpace = Field(
        IdSpace.INDEX, description="index: ids are rows (0..rows-1); raw: any int64 id, mapped to rows by remap"
    )
    remap: RemapSpec | None = Field(
        None, description="ids raw only: the managed collisions that map raw ids to rows (rows: the slots)"
    )
    sharding: ShardingType = Field(ShardingType.AUTO, description="TorchRec inference sharding")
    shard: Name | None = Field(
        None,
        description="distributed serving: the embedding shard (its own TorchServe hosts) that "
        "serves this table; give every table one, or none",
    )

    def ids_of(self, feature: str) -> IdsPerItem:
        """The id counts one bag of ``feature`` (one of this table's) may hold."""
        return self.ids_per_feature.get(feature, self.ids_per_item)

    @property
    def served_rows(self) -> int:
        """Rows the served table holds: ``pruned_to`` when pruned."""
        return self.pruned_to or self.rows

    @model_validator(mode="after")
    def _servable(self) -> "TableSpec":
        if self.name in _MODULE_DICT_ATTRIBUTES:
            raise ValueError(f"name: {self.name!r} is taken by TorchRec's module dict of tables; rename it")
        if self.pruned_to is not None and self.pruned_to >= self.rows:
            raise ValueError(f"pruned_to: must be below rows ({self.rows}) to prune any, got {self.pruned_to}")
        if self.pruned_to is not None and self.pooling == Pooling.NONE:
            raise ValueError("pruned_to: sequence tables (pooling none) are served unpruned")
        if (self.remap is None) == (self.ids == IdSpace.RAW):
            raise ValueError("remap: a table with ids raw names its remap, and only such a table")
        if self.ids == IdSpace.RAW:
            for key, given, why in (
                ("pruned_to", self.pruned_to is not None, "managed collisions already bound its rows"),
                ("pooling", self.pooling == Pooling.NONE, "sequence tables with raw ids are not served yet"),
                ("sharding", self.sharding != ShardingType.AUTO, "raw-id tables are served unsharded"),
                ("shard", self.shard is not None, "raw-id tables are not placed on shards yet"),
            ):
                if given:
                    raise ValueError(f"{key}: ids raw: {why}")
            if self.rows % self.remap.buckets:
                raise ValueError(f"remap.buckets: rows ({self.rows}) must split evenly into {self.remap.buckets} buckets")
        unknown = sorted(set(self.ids_per_feature) - set(self.features))
        if unknown:
            raise ValueError(f"ids_per_feature.{unknown[0]}: not a feature of this table ({', '.join(self.features)})")
        if self.max_sequence_length is not None and self.pooling != Pooling.NONE:
            raise ValueError("max_sequence_length: only for sequence tables (pooling: none)")
        per_byte = self.weight_dtype.values_per_byte
        if self.dim % per_byte:
            raise ValueError(
                f"dim: {self.weight_dtype.value} tables pack {per_byte} values per byte: dim must be a "
                f"multiple of {per_byte}, got {self.dim}"
            )
        if self.sharding == ShardingType.COLUMN_WISE:
            # Measured on torchrec 1.8: the quantized sharder splits the packed byte rows, not the
            # embedding dim, so pooled outputs come back twice as wide and the model fails.
            raise ValueError(
                "sharding: column_wise sharding of quantized tables is broken in torchrec 1.8 "
                "inference (it splits the packed byte rows); use table_wise or row_wise"
            )
        return self


class ShardingSpec(Section):
    """Where the model runs: ``world_size`` ranks of one device type."""

    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="cuda: each worker runs on the GPU TorchServe assigns it"
    )
    world_size: PositiveInt = Field(1, description="ranks the tables are sharded over")


class CheckpointMapping(Section):
    """Rewrites checkpoint parameter names into the model's, by prefix, in declaration order.

    ``{"model.": ""}`` strips the prefix of TorchRec's ``DLRMTrain`` wrapper; a full table prefix
    renames a table.
    """

    prefixes: dict[StrictStr, StrictStr] = Field(
        {}, description="checkpoint name prefix -> model name prefix, applied in order"
    )

    def apply(self, name: str) -> str:
        for old, new in self.prefixes.items():
            if name.startswith(old):
                name = new + name[len(old) :]
        return name


class ModelSpec(Section):
    """What every architecture's spec has. ``dense_features``: per-item dense input width;
    ``weighted_ids``: every id may carry a float weight (weighted sum pooling);
    ``dense_precision``: submodule -> precision for the served model, fp32 where unnamed."""

    # The dense submodules (attribute names on the model) that dense_precision may name.
    DENSE_SUBMODULES: ClassVar[tuple[str, ...]] = ()

    name: Name = Field(description="the model's name (the archive's, unless the build names another)")
    architecture: str
    dense_features: PositiveInt = Field(description="dense (float) features per item")
    tables: Annotated[tuple[TableSpec, ...], Field(min_length=1)] = Field(
        description="the embedding tables, in model order"
    )
    weighted_ids: StrictBool = Field(False, description="ids may carry float weights (sum pooling)")
    dense_precision: dict[str, DensePrecision] = Field(
        {}, description="dense submodule -> precision in the served model (fp32 where not named)"
    )
    sharding: ShardingSpec = Field(ShardingSpec(), description="where the model runs")
    out_of_range: OutOfRangePolicy = Field(
        OutOfRangePolicy.REJECT, description="an id outside its table: reject (400) or hash (mod rows)"
    )
    limits: LimitsSpec = Field(LimitsSpec(), description="caps on requests and forwards")
    checkpoint_mapping: CheckpointMapping = Field(
        CheckpointMapping(), description="how trained checkpoint names map to the model's"
    )
    pruning: StrictStr | None = Field(
        None,
        description="the ids each pruned table (tables[].pruned_to) keeps: a torch.save file of {table: "
        "int64 ids, ascending}, as torchrec-serve plan --prune writes it; relative to the spec's folder",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "ModelSpec":
        seen_tables: set[str] = set()
        seen_features: set[str] = set()
        for i, t in enumerate(self.tables):
            if t.name in seen_tables:
                raise ValueError(f"tables[{i}].name: duplicate table name {t.name!r}")
            seen_tables.add(t.name)
            for f in t.features:
                if f in seen_features:
                    raise ValueError(f"tables[{i}].features: feature {f!r} is used by two tables")
                seen_features.add(f)
            cap = t.max_sequence_length or self.limits.max_ids_per_bag
            for f in t.features:
                counts, key = t.ids_of(f), "ids_per_feature." + f if f in t.ids_per_feature else "ids_per_item"
                if max(counts.min, counts.max or 0) > cap:
                    raise ValueError(
                        f"tables[{i}].{key}: at most the bag cap ({cap}: max_sequence_length or "
                        f"limits.max_ids_per_bag), got {counts.max or counts.min}"
                    )
            if self.weighted_ids and t.pooling != Pooling.SUM:
                raise ValueError(
                    f"tables[{i}].pooling: weighted_ids needs sum pooling (per-id weights scale a "
                    f"sum), got {t.pooling.value}"
                )
            if t.pooling == Pooling.NONE and (self.is_sharded or t.shard is not None):
                raise ValueError(
                    f"tables[{i}].pooling: sequence tables (pooling none) are served whole on one host; "
                    "remove the table's sharding and shard settings"
                )
            if t.sharding == ShardingType.ROW_WISE and t.pooling == Pooling.MEAN:
                # Measured: each row shard averages only its own ids, so the sum of shard means is wrong.
                raise ValueError(
                    f"tables[{i}].sharding: row_wise sharding gives wrong results with mean pooling "
                    "(each shard averages its own ids); use table_wise or sum pooling"
                )
            if self.is_sharded and t.weight_dtype in (WeightDtype.FP32, WeightDtype.FP16):
                # Measured on torchrec 1.8: its inference sharding needs per-row scale/bias.
                raise ValueError(
                    f"tables[{i}].weight_dtype: a sharded model needs int8, int4 or int2 tables (torchrec "
                    f"1.8 inference sharding cannot shard {t.weight_dtype.value} tables), got "
                    f"{t.weight_dtype.value}"
                )
        pruned = [t.name for t in self.tables if t.pruned_to is not None]
        if pruned and self.pruning is None:
            raise ValueError(f"pruning: tables {pruned} are pruned (pruned_to): name the file of the ids they keep")
        if self.pruning is not None and not pruned:
            raise ValueError("pruning: no table is pruned (tables[].pruned_to)")
        raw = [i for i, t in enumerate(self.tables) if t.ids == IdSpace.RAW]
        if raw and self.is_sharded:
            raise ValueError(f"tables[{raw[0]}].ids: raw-id tables are served unsharded (sharding.world_size 1)")
        if pruned and self.is_sharded:
            raise ValueError(
                f"tables[{[t.name for t in self.tables].index(pruned[0])}].pruned_to: pruned tables are not "
                "sharded with TorchRec; serve them whole, or on a distributed layout's shard"
            )
        placed = [t.shard is not None for t in self.tables]
        if any(placed) and not all(placed):
            i = placed.index(False)
            raise ValueError(
                f"tables[{i}].shard: missing; once one table names its shard, every table must"
            )
        for name in self.dense_precision:
            if name not in self.DENSE_SUBMODULES:
                raise ValueError(
                    f"dense_precision.{name}: not a dense submodule of {self.architecture} "
                    f"(one of {', '.join(self.DENSE_SUBMODULES)})"
                )
        return self

    @property
    def is_sharded(self) -> bool:
        """Sharded with TorchRec when spread over several ranks or a table asks for a layout."""
        return self.sharding.world_size > 1 or any(
            t.sharding != ShardingType.AUTO for t in self.tables
        )

    def servable_dtypes(self, table: TableSpec) -> tuple[WeightDtype, ...]:
        """The dtypes ``table`` could be served in by this model, widest first."""
        floats = (WeightDtype.FP32, WeightDtype.FP16)
        return tuple(
            d for d in WeightDtype
            if table.dim % d.values_per_byte == 0 and not (self.is_sharded and d in floats)
        )

    @property
    def raw_id_tables(self) -> tuple[str, ...]:
        """The tables whose ids are raw (``ids: raw``), in model order."""
        return tuple(t.name for t in self.tables if t.ids == IdSpace.RAW)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """All sparse features in model order: the tables' features, table by table."""
        return tuple(f for t in self.tables for f in t.features)

    @property
    def feature_rows(self) -> tuple[int, ...]:
        """Row count of the table behind each feature, aligned with ``feature_names``."""
        return tuple(t.rows for t in self.tables for _ in t.features)

    @property
    def feature_dims(self) -> tuple[int, ...]:
        """Width of each feature's pooled embedding (its table's dim), aligned with ``feature_names``."""
        return tuple(t.dim for t in self.tables for _ in t.features)

    @property
    def shards(self) -> dict[str, tuple[TableSpec, ...]]:
        """Shard name -> its tables, in model order (empty: the model is served on one host)."""
        shards: dict[str, list[TableSpec]] = {}
        for t in self.tables:
            if t.shard is not None:
                shards.setdefault(t.shard, []).append(t)
        return {name: tuple(tables) for name, tables in shards.items()}

    def shard_spec(self, shard: str) -> "ModelSpec":
        """The spec of one shard's lookups: its tables only, named ``<model>-<shard>``."""
        tables = self.shards[shard]
        pruning = self.pruning if any(t.pruned_to is not None for t in tables) else None
        return self.replace(name=f"{self.name}-{shard}", tables=tables, pruning=pruning)

    @property
    def min_requests(self) -> int:
        """The fewest requests (and items) a graph of this model is captured for: 2 where TorchAO's
        int8 dynamic activation quantization guards against batch 1, else 1."""
        return 2 if DensePrecision.INT8_DYNAMIC in self.dense_precision.values() else 1

    def replace(self, **changes: Any) -> "ModelSpec":
        """A validated copy with ``changes`` applied (sections may be given as models or dicts)."""
        return type(self).model_validate({**dict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-safe values; ``parse_spec(spec.to_dict()) == spec``."""
        return self.model_dump(mode="json")

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
