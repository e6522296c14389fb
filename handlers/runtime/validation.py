"""The checks every request passes, whatever its wire format: item counts, bag sizes and ids
against the tables (with the model's out-of-range policy).

``field_of(feature, item, id_index)`` callbacks name a spot in the request as its format spells it,
e.g. ``items[2].sparse.cat_4[1]``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import InputSchema, OutOfRangePolicy

FieldOf = Callable[[int, int, "int | None"], str]


class RequestChecks:
    """Validates one request's sizes and ids for one model."""

    def __init__(self, schema: InputSchema) -> None:
        self.schema = schema
        self._feature_rows = np.asarray(schema.feature_rows, dtype=np.int64)

    def item_count(self, field: str, count: int) -> None:
        cap = self.schema.limits.max_items_per_request
        if count > cap:
            raise BadRequest(field, f"{count} items exceed the limit of {cap} per request", "too_large")

    def ids(self, ids: np.ndarray, lengths: np.ndarray, field_of: FieldOf) -> tuple[np.ndarray, int]:
        """Checks ids (int64, feature-major) against bag caps and table rows; returns them with the
        out-of-range policy applied, and how many it hashed. ``lengths``: [F, n] bag sizes."""
        cap = self.schema.limits.max_ids_per_bag
        if lengths.size and lengths.max() > cap:
            f, i = np.unravel_index(int(np.argmax(lengths)), lengths.shape)
            raise BadRequest(
                field_of(int(f), int(i), None),
                f"{int(lengths[f, i])} ids exceed the limit of {cap} per bag",
                "too_large",
            )
        if (ids < 0).any():
            k = int(np.argmax(ids < 0))
            raise BadRequest(
                field_of(*bag_position(lengths, k)), f"ids must be >= 0, got {ids[k]}", "id_out_of_range"
            )
        rows = np.repeat(self._feature_rows, lengths.sum(axis=1))
        beyond = ids >= rows
        if beyond.any():
            if self.schema.out_of_range == OutOfRangePolicy.HASH:
                return np.where(beyond, ids % rows, ids), int(beyond.sum())
            k = int(np.argmax(beyond))
            raise BadRequest(
                field_of(*bag_position(lengths, k)),
                f"id {ids[k]} is outside the table's {int(rows[k])} rows",
                "id_out_of_range",
            )
        return ids, 0


def bag_position(lengths: np.ndarray, k: int) -> tuple[int, int, int]:
    """Value index ``k`` of feature-major bags ``lengths`` [F, n] -> (feature, item, index in bag)."""
    offsets = np.cumsum(lengths.reshape(-1))
    bag = int(np.searchsorted(offsets, k, side="right"))
    f, i = divmod(bag, lengths.shape[1])
    start = int(offsets[bag - 1]) if bag else 0
    return f, i, k - start
