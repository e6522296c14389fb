"""What a build is about to serve, printed before it starts: every table's served dtype, rows and
bytes, and each setting the spec left to its default, marked as such."""

from __future__ import annotations

from pydantic import BaseModel

from handlers.modeling.factory import DLRMFactory
from handlers.modeling.spec import ModelSpec


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
    limits = spec.limits
    lines += [
        f"  out_of_range: {_shown(spec, 'out_of_range')}; dense precision: "
        + (", ".join(f"{k} {v.value}" for k, v in spec.dense_precision.items()) or "fp32 (default)"),
        f"  limits{'' if 'limits' in spec.model_fields_set else ' (default)'}: "
        f"{limits.max_items_per_request} items per request, {limits.max_ids_per_bag} ids per bag, "
        f"{limits.max_items_per_forward} items per forward",
    ]
    return lines


def _shown(section: BaseModel, key: str) -> str:
    value = getattr(section, key)
    text = getattr(value, "value", value)
    return f"{text}" if key in section.model_fields_set else f"{text} (default)"


def human_size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
