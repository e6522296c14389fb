"""One typed description of a model (DLRM or a context ranker), shared by the factory, the archive tool, the handler and the tests.

A spec is parsed once from YAML (``ModelSpec.from_yaml``) and validated on construction; every
error names the offending key, e.g. ``tables[2].dim: must equal bottom_mlp[-1] (64), got 32``.

Example (``config/models/tiny.yaml``)::

    name: tiny
    dense_features: 4
    bottom_mlp: [16, 8]
    top_mlp: [16, 1]
    tables:
      - {name: t_user, rows: 100, dim: 8, features: [user_id], weight_dtype: int8}
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any, Mapping

import yaml

from handlers.errors import SpecError


class Architecture(str, enum.Enum):
    """``dlrm``: TorchRec's DLRM over per-item features. ``context_ranker``: per-item (candidate)
    features plus request-level context features, computed once per request and broadcast to its
    items inside the model (``handlers.models.ContextRanker``)."""

    DLRM = "dlrm"
    CONTEXT_RANKER = "context_ranker"


class DensePrecision(str, enum.Enum):
    """How one dense submodule (an MLP) runs in the served model: a float dtype, or TorchAO int8
    weights with float (weight-only) or per-call int8 (dynamic) activations."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8_WEIGHT_ONLY = "int8_weight_only"
    INT8_DYNAMIC = "int8_dynamic"


# The dense submodules of each architecture, by attribute name on the model.
DENSE_SUBMODULES = {
    Architecture.DLRM: ("dense_arch", "over_arch"),
    Architecture.CONTEXT_RANKER: ("dense_arch", "context_arch", "over_arch"),
}


class Pooling(str, enum.Enum):
    SUM = "sum"
    MEAN = "mean"


class WeightDtype(str, enum.Enum):
    """Storage dtype of one embedding table in the served model (FBGEMM TBE kernels)."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"


class ShardingType(str, enum.Enum):
    """TorchRec inference sharding of one table; ``auto`` lets TorchRec's planner choose."""

    AUTO = "auto"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"


class OutOfRangePolicy(str, enum.Enum):
    """What happens to an id outside ``[0, rows)``: a 400, or ``id mod rows``."""

    REJECT = "reject"
    HASH = "hash"


@dataclasses.dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    pooling: Pooling = Pooling.SUM
    weight_dtype: WeightDtype = WeightDtype.INT8
    sharding: ShardingType = ShardingType.AUTO


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """Where the model runs: ``world_size`` ranks of one device type (``cpu`` or ``cuda``)."""

    device: str = "cpu"
    world_size: int = 1


@dataclasses.dataclass(frozen=True)
class Limits:
    """Caps on a single request; anything above is a 400 naming the field."""

    max_items_per_request: int = 1024
    max_ids_per_bag: int = 256
    max_items_per_forward: int = 4096


@dataclasses.dataclass(frozen=True)
class CheckpointMapping:
    """Rewrites checkpoint parameter names into the model's, by prefix, in declaration order.

    ``{"module.": ""}`` strips DistributedModelParallel's prefix; a full table prefix renames a table.
    """

    prefixes: tuple[tuple[str, str], ...] = ()

    def apply(self, name: str) -> str:
        for old, new in self.prefixes:
            if name.startswith(old):
                name = new + name[len(old) :]
        return name


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``dense_features``/``bottom_mlp``: per-item dense input and its MLP; ``context_features``/
    ``context_mlp``: the per-request context input of a ``context_ranker`` (0 / () for DLRM);
    ``weighted_ids``: every id may carry a float weight (weighted sum pooling);
    ``dense_precision``: (submodule, precision) pairs for the served model, fp32 where unnamed."""

    name: str
    dense_features: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    tables: tuple[TableSpec, ...]
    architecture: Architecture = Architecture.DLRM
    context_features: int = 0
    context_mlp: tuple[int, ...] = ()
    weighted_ids: bool = False
    dense_precision: tuple[tuple[str, DensePrecision], ...] = ()
    sharding: ShardingSpec = ShardingSpec()
    out_of_range: OutOfRangePolicy = OutOfRangePolicy.REJECT
    limits: Limits = Limits()
    checkpoint_mapping: CheckpointMapping = CheckpointMapping()

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def is_sharded(self) -> bool:
        """Sharded with TorchRec when spread over several ranks or a table asks for a layout."""
        return self.sharding.world_size > 1 or any(
            t.sharding != ShardingType.AUTO for t in self.tables
        )

    @property
    def feature_names(self) -> tuple[str, ...]:
        """All sparse features in model order: the tables' features, table by table."""
        return tuple(f for t in self.tables for f in t.features)

    @property
    def feature_rows(self) -> tuple[int, ...]:
        """Row count of the table behind each feature, aligned with ``feature_names``."""
        return tuple(t.rows for t in self.tables for _ in t.features)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ModelSpec":
        text = Path(path).read_text()
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SpecError(f"{path}: not valid YAML: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Any) -> "ModelSpec":
        return _parse_model(raw)

    def to_dict(self) -> dict[str, Any]:
        """The inverse of ``from_dict``: plain YAML-safe values."""
        context = (
            {"context_features": self.context_features, "context_mlp": list(self.context_mlp)}
            if self.architecture == Architecture.CONTEXT_RANKER
            else {}
        )
        return {
            "name": self.name,
            "architecture": self.architecture.value,
            "dense_features": self.dense_features,
            **context,
            "bottom_mlp": list(self.bottom_mlp),
            "top_mlp": list(self.top_mlp),
            "weighted_ids": self.weighted_ids,
            "dense_precision": {name: p.value for name, p in self.dense_precision},
            "tables": [
                {
                    "name": t.name,
                    "rows": t.rows,
                    "dim": t.dim,
                    "features": list(t.features),
                    "pooling": t.pooling.value,
                    "weight_dtype": t.weight_dtype.value,
                    "sharding": t.sharding.value,
                }
                for t in self.tables
            ],
            "sharding": dataclasses.asdict(self.sharding),
            "out_of_range": self.out_of_range.value,
            "limits": dataclasses.asdict(self.limits),
            "checkpoint_mapping": {"prefixes": dict(self.checkpoint_mapping.prefixes)},
        }

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


# ---------------------------------------------------------------------------------------------
# Parsing: raw YAML -> typed objects; every error names its key path.


def _parse_model(raw: Any) -> ModelSpec:
    obj = _Obj(raw, "spec")
    architecture = obj.enum("architecture", Architecture, Architecture.DLRM)
    has_context = architecture == Architecture.CONTEXT_RANKER
    spec = ModelSpec(
        name=obj.str("name"),
        architecture=architecture,
        dense_features=obj.positive_int("dense_features"),
        context_features=obj.positive_int("context_features") if has_context else 0,
        context_mlp=obj.int_list("context_mlp") if has_context else (),
        bottom_mlp=obj.int_list("bottom_mlp"),
        top_mlp=obj.int_list("top_mlp"),
        weighted_ids=obj.bool("weighted_ids", False),
        tables=tuple(_parse_table(t, f"tables[{i}]") for i, t in enumerate(obj.list("tables"))),
        dense_precision=_parse_precision(obj.get("dense_precision", {}), "dense_precision"),
        sharding=_parse_sharding(obj.get("sharding", {}), "sharding"),
        out_of_range=obj.enum("out_of_range", OutOfRangePolicy, OutOfRangePolicy.REJECT),
        limits=_parse_limits(obj.get("limits", {}), "limits"),
        checkpoint_mapping=_parse_mapping(obj.get("checkpoint_mapping", {}), "checkpoint_mapping"),
    )
    obj.reject_unknown()
    return spec


def _parse_table(raw: Any, path: str) -> TableSpec:
    obj = _Obj(raw, path)
    features = obj.list("features")
    for i, f in enumerate(features):
        if not isinstance(f, str) or not f:
            raise SpecError(f"{path}.features[{i}]: must be a non-empty string, got {f!r}")
    table = TableSpec(
        name=obj.str("name"),
        rows=obj.positive_int("rows"),
        dim=obj.positive_int("dim"),
        features=tuple(features),
        pooling=obj.enum("pooling", Pooling, Pooling.SUM),
        weight_dtype=obj.enum("weight_dtype", WeightDtype, WeightDtype.INT8),
        sharding=obj.enum("sharding", ShardingType, ShardingType.AUTO),
    )
    obj.reject_unknown()
    return table


def _parse_precision(raw: Any, path: str) -> tuple[tuple[str, DensePrecision], ...]:
    obj = _Obj(raw, path)
    pairs = tuple(
        (name, obj.enum(name, DensePrecision, DensePrecision.FP32)) for name in list(raw)
    )
    return pairs


def _parse_sharding(raw: Any, path: str) -> ShardingSpec:
    obj = _Obj(raw, path)
    spec = ShardingSpec(
        device=obj.str("device", "cpu"), world_size=obj.positive_int("world_size", 1)
    )
    obj.reject_unknown()
    if spec.device not in ("cpu", "cuda"):
        raise SpecError(f"{path}.device: must be 'cpu' or 'cuda', got {spec.device!r}")
    return spec


def _parse_limits(raw: Any, path: str) -> Limits:
    obj = _Obj(raw, path)
    defaults = Limits()
    limits = Limits(
        max_items_per_request=obj.positive_int(
            "max_items_per_request", defaults.max_items_per_request
        ),
        max_ids_per_bag=obj.positive_int("max_ids_per_bag", defaults.max_ids_per_bag),
        max_items_per_forward=obj.positive_int(
            "max_items_per_forward", defaults.max_items_per_forward
        ),
    )
    obj.reject_unknown()
    return limits


def _parse_mapping(raw: Any, path: str) -> CheckpointMapping:
    obj = _Obj(raw, path)
    prefixes = obj.get("prefixes", {})
    if not isinstance(prefixes, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prefixes.items()
    ):
        raise SpecError(f"{path}.prefixes: must map old prefix -> new prefix (strings)")
    obj.reject_unknown()
    return CheckpointMapping(prefixes=tuple(prefixes.items()))


def _validate(spec: ModelSpec) -> None:
    if not spec.tables:
        raise SpecError("tables: at least one table is required")
    if spec.top_mlp[-1] != 1:
        raise SpecError(f"top_mlp: last layer must be 1 (one logit), got {spec.top_mlp[-1]}")
    seen_tables: set[str] = set()
    seen_features: set[str] = set()
    for i, t in enumerate(spec.tables):
        if t.name in seen_tables:
            raise SpecError(f"tables[{i}].name: duplicate table name {t.name!r}")
        seen_tables.add(t.name)
        if spec.architecture == Architecture.DLRM and t.dim != spec.bottom_mlp[-1]:
            raise SpecError(
                f"tables[{i}].dim: must equal bottom_mlp[-1] ({spec.bottom_mlp[-1]}) so DLRM can "
                f"take dot products, got {t.dim}"
            )
        if not t.features:
            raise SpecError(f"tables[{i}].features: at least one feature is required")
        for f in t.features:
            if f in seen_features:
                raise SpecError(f"tables[{i}].features: feature {f!r} is used by two tables")
            seen_features.add(f)
        if spec.weighted_ids and t.pooling != Pooling.SUM:
            raise SpecError(
                f"tables[{i}].pooling: weighted_ids needs sum pooling (per-id weights scale a sum), "
                f"got {t.pooling.value}"
            )
        if t.weight_dtype == WeightDtype.INT4 and t.dim % 2:
            raise SpecError(f"tables[{i}].dim: int4 tables need an even dim, got {t.dim}")
        if t.sharding == ShardingType.COLUMN_WISE:
            # Measured on torchrec 1.8: the quantized sharder splits the packed byte rows, not the
            # embedding dim, so pooled outputs come back twice as wide and the model fails.
            raise SpecError(
                f"tables[{i}].sharding: column_wise sharding of quantized tables is broken in "
                "torchrec 1.8 inference (it splits the packed byte rows); use table_wise or row_wise"
            )
    for i, t in enumerate(spec.tables):
        if t.sharding == ShardingType.ROW_WISE and t.pooling == Pooling.MEAN:
            # Measured: each row shard averages only its own ids, so the sum of shard means is wrong.
            raise SpecError(
                f"tables[{i}].sharding: row_wise sharding gives wrong results with mean pooling "
                "(each shard averages its own ids); use table_wise or sum pooling"
            )
        if spec.is_sharded and t.weight_dtype in (WeightDtype.FP32, WeightDtype.FP16):
            # Measured on torchrec 1.8: its inference sharding needs per-row scale/bias.
            raise SpecError(
                f"tables[{i}].weight_dtype: a sharded model needs int8 or int4 tables (torchrec 1.8 "
                f"inference sharding cannot shard {t.weight_dtype.value} tables), got "
                f"{t.weight_dtype.value}"
            )
    submodules = DENSE_SUBMODULES[spec.architecture]
    for name, _ in spec.dense_precision:
        if name not in submodules:
            raise SpecError(
                f"dense_precision.{name}: not a dense submodule of {spec.architecture.value} "
                f"(one of {', '.join(submodules)})"
            )
    lim = spec.limits
    if lim.max_items_per_request > lim.max_items_per_forward:
        raise SpecError(
            "limits.max_items_per_request: must not exceed limits.max_items_per_forward "
            f"({lim.max_items_per_forward}), got {lim.max_items_per_request}"
        )


class _Obj:
    """A YAML mapping being parsed: typed getters that name ``path.key`` in their errors."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, Mapping):
            raise SpecError(f"{path}: must be a mapping, got {type(raw).__name__}")
        self._raw = raw
        self._path = path
        self._used: set[str] = set()

    def get(self, key: str, default: Any = ...) -> Any:
        self._used.add(key)
        if key in self._raw:
            return self._raw[key]
        if default is ...:
            raise SpecError(f"{self._path}.{key}: required key is missing")
        return default

    def str(self, key: str, default: Any = ...) -> str:
        value = self.get(key, default)
        if not isinstance(value, str) or not value:
            raise SpecError(f"{self._path}.{key}: must be a non-empty string, got {value!r}")
        return value

    def positive_int(self, key: str, default: Any = ...) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SpecError(f"{self._path}.{key}: must be a positive integer, got {value!r}")
        return value

    def list(self, key: str) -> list:
        value = self.get(key)
        if not isinstance(value, list) or not value:
            raise SpecError(f"{self._path}.{key}: must be a non-empty list, got {value!r}")
        return value

    def bool(self, key: str, default: Any = ...) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise SpecError(f"{self._path}.{key}: must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.list(key)
        for i, v in enumerate(value):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SpecError(f"{self._path}.{key}[{i}]: must be a positive integer, got {v!r}")
        return tuple(value)

    def enum(self, key: str, kind: type[enum.Enum], default: enum.Enum) -> Any:
        value = self.get(key, default.value)
        try:
            return kind(value)
        except ValueError:
            choices = ", ".join(m.value for m in kind)
            raise SpecError(
                f"{self._path}.{key}: must be one of {choices}, got {value!r}"
            ) from None

    def reject_unknown(self) -> None:
        unknown = sorted(set(self._raw) - self._used)
        if unknown:
            raise SpecError(f"{self._path}: unknown key(s) {', '.join(map(repr, unknown))}")
