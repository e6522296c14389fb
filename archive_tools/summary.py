"""What a build is about to serve, printed before it starts: every table's served dtype, rows and
bytes, and each setting the spec left to its default, marked as such."""

from __future__ import annotations

from pydantic import BaseModel

from handlers.modeling.factory import DLRMFactory
from handlers.modeling.remap_spec import RemapKind
from handlers.modeling.spec import ModelSpec, TableSpec
from handlers.runtime.slot_maps import HASHED_PARTS, SORTED_PARTS

_PARTS = {RemapKind.MCH: SORTED_PARTS, RemapKind.ZCH: HASHED_PARTS}  # a raw-id table's slot map tensors


def spec_summary(spec: ModelSpec, factory: DLRMFactory) -> list[str]:
    table_bytes = factory.table_bytes()
    total = sum(table_bytes.values())
    lines = [
        f"spec {spec.name} ({spec.architecture}): {spec.dense_features} dense features, "
        f"{len(spec.feature_names)} sparse features in {len(spec.tables)} tables, "
        f"{human_size(total)} of tables served",
        f"  {'table':<16}{'rows (kept/ids)':>20}{'dim':>6}  {'dtype':<17}{'pooling':<15}{'served':>11}",
    ]
    for table in spec.tables:
        rows = f"{table.rows:,}" if table.pruned_to is None else f"{table.pruned_to:,}/{table.rows:,}"
        lines.append(
            f"  {table.name:<16}{rows:>20}{table.dim:>6}  "
            f"{_shown(table, 'weight_dtype'):<17}{_shown(table, 'pooling'):<15}"
            f"{human_size(table_bytes[table.name]):>11}"
        )
    raw = [t for t in spec.tables if t.remap is not None]
    if raw:  # their slot maps lie beside the tables: an int64 a slot per part (MCH 2, ZCH 1)
        maps = sum(t.rows * 8 * len(_PARTS[t.remap.kind]) for t in raw)  # type: ignore[union-attr]
        lines.append(f"  raw ids: {', '.join(_remap(t) for t in raw)}; slot maps {human_size(maps)} beside the tables")
    limits = spec.limits
    lines += [
        f"  out_of_range: {_shown(spec, 'out_of_range')}; dense precision: "
        + (", ".join(f"{k} {v.value}" for k, v in spec.dense_precision.items()) or "fp32 (default)"),
        f"  limits{'' if 'limits' in spec.model_fields_set else ' (default)'}: "
        f"{limits.max_items_per_request} items per request, {limits.max_ids_per_bag} ids per bag, "
        f"{limits.max_items_per_forward} items per forward",
    ]
    return lines


def _remap(table: TableSpec) -> str:
    remap = table.remap
    assert remap is not None
    settings = (f"eviction {remap.eviction.value}" if remap.kind == RemapKind.MCH
                else f"max_probe {remap.max_probe}, buckets {remap.buckets}")
    return f"{table.name} {remap.kind.value} ({settings}, unseen {remap.unseen.value})"  # type: ignore[union-attr]


def _shown(section: BaseModel, key: str) -> str:
    value = getattr(section, key)
    text = getattr(value, "value", value)
    return f"{text}" if key in section.model_fields_set else f"{text} (default)"


def human_size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
