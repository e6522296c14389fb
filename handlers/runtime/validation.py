"""The checks every request passes, whatever its wire format: item counts, bag sizes and ids
against the tables (with the model's out-of-range policy).

``field_of(feature, item, id_index)`` callbacks name a spot in the request as its format spells it,
e.g. ``items[2].sparse.cat_4[1]``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import MCH_FREE_SLOT, Feature, InputSchema, OutOfRangePolicy

FieldOf = Callable[[int, int, "int | None"], str]


class RequestChecks:
    """Validates one request's sizes and ids for one model: ``ids`` for the items' features,
    ``context_ids`` for the features sent once per request."""

    def __init__(self, schema: InputSchema) -> None:
        self.schema = schema
        self._items = _IdChecks(schema.features, schema.limits.max_ids_per_bag, schema.out_of_range)
        self._context = _IdChecks(schema.context_sparse, schema.limits.max_ids_per_bag, schema.out_of_range)

    def item_count(self, field: str, count: int) -> None:
        cap = self.schema.limits.max_items_per_request
        if count > cap:
            raise BadRequest(field, f"{count} items exceed the limit of {cap} per request", "too_large")

    def ids(self, ids: np.ndarray, lengths: np.ndarray, field_of: FieldOf) -> tuple[np.ndarray, int]:
        """Checks ids (int64, feature-major) against bag caps and table rows; returns them with the
        out-of-range policy applied, and how many it hashed. ``lengths``: [F, n] bag sizes."""
        return self._items.check(ids, lengths, field_of)

    def context_ids(self, ids: np.ndarray, lengths: np.ndarray, field_of: FieldOf) -> tuple[np.ndarray, int]:
        """``ids`` for the per-request features: ``lengths`` [F, K], one column per request."""
        return self._context.check(ids, lengths, field_of)


class _IdChecks:
    """The checks of one jagged input's features: each one's cap (a sequence feature's
    ``max_length``, else ``max_ids_per_bag``) and its table's rows; a raw-id feature takes any
    int64 id but the one its remap marks free slots with (the model maps them to rows)."""

    def __init__(self, features: Sequence[Feature], bag_cap: int, policy: OutOfRangePolicy) -> None:
        self.raw = np.asarray([f.raw_id_table is not None for f in features], dtype=bool)
        # an archive built before ZCH names no reserved id: its raw-id tables are MCH's
        self.reserved = np.asarray(
            [MCH_FREE_SLOT if f.reserved_raw_id is None else f.reserved_raw_id for f in features], np.int64
        )
        # every feature raw (a raw-id model's, often one kind): the reserved ids are the only check
        self.all_raw = len(features) > 0 and bool(self.raw.all())
        self.one_reserved = int(self.reserved[0]) if len(set(self.reserved.tolist())) == 1 else None
        self.rows = np.asarray([f.rows for f in features], np.int64)  # a raw-id feature's: not a bound
        self.caps = np.asarray([f.max_ids or f.max_length or bag_cap for f in features], dtype=np.int64)
        self.smallest_cap = int(self.caps.min()) if len(features) else bag_cap
        self.counted = [f.max_ids is not None for f in features]  # the spec's ids_per_item.max
        self.sequences = [f.max_length is not None for f in features]
        self.mins = np.asarray([f.min_ids for f in features], dtype=np.int64)
        self.largest_min = int(self.mins.max()) if len(features) else 0
        self.policy = policy

    def check(self, ids: np.ndarray, lengths: np.ndarray, field_of: FieldOf) -> tuple[np.ndarray, int]:
        over = lengths > self.caps[:, None] if lengths.size and lengths.max() > self.smallest_cap else None
        if over is not None and over.any():
            f, i = np.unravel_index(int(np.argmax(over)), lengths.shape)
            cap, what = int(self.caps[f]), "sequence" if self.sequences[f] else "bag"
            limit = f"the limit of {cap} per {what}" + (" (ids_per_item.max)" if self.counted[f] else "")
            raise BadRequest(field_of(int(f), int(i), None), f"{int(lengths[f, i])} ids exceed {limit}", "too_large")
        if self.largest_min and lengths.size:
            self._refuse_too_few(lengths, field_of)
        per_feature = lengths.sum(axis=1)
        if self.all_raw:
            self._refuse_reserved(ids, lengths, per_feature, field_of, raw=None)
            return ids, 0
        negative, beyond = ids < 0, ids >= np.repeat(self.rows, per_feature)
        if self.raw.any():
            raw = np.repeat(self.raw, per_feature)
            self._refuse_reserved(ids, lengths, per_feature, field_of, raw)
            negative &= ~raw
            beyond &= ~raw
        if negative.any():
            k = int(np.argmax(negative))
            raise BadRequest(
                field_of(*bag_position(lengths, k)), f"ids must be >= 0, got {ids[k]}", "id_out_of_range"
            )
        if beyond.any():
            rows = np.repeat(self.rows, per_feature)
            if self.policy == OutOfRangePolicy.HASH:
                return np.where(beyond, ids % rows, ids), int(beyond.sum())
            k = int(np.argmax(beyond))
            raise BadRequest(
                field_of(*bag_position(lengths, k)),
                f"id {ids[k]} is outside the table's {int(rows[k])} rows",
                "id_out_of_range",
            )
        return ids, 0

    def _refuse_too_few(self, lengths: np.ndarray, field_of: FieldOf) -> None:
        """Raises ``BadRequest`` at the first bag holding fewer ids than its feature's ``min_ids``
        (a feature the model needs, left out or sent empty)."""
        under = lengths < self.mins[:, None]
        if under.any():
            f, i = np.unravel_index(int(np.argmax(under)), lengths.shape)
            least, got = int(self.mins[f]), int(lengths[f, i])
            raise BadRequest(
                field_of(int(f), int(i), None),
                f"required: the model takes at least {least} id{'s' if least > 1 else ''} here "
                f"(ids_per_item.min), got {got}",
                "missing_field" if got == 0 else "bad_value",
            )

    def _refuse_reserved(
        self, ids: np.ndarray, lengths: np.ndarray, per_feature: np.ndarray, field_of: FieldOf, raw: np.ndarray | None
    ) -> None:
        """Raises ``BadRequest`` at the first raw id its table reserves (``raw``: which ids are
        raw-id features', None: all)."""
        marker = self.one_reserved if self.one_reserved is not None else np.repeat(self.reserved, per_feature)
        reserved = ids == marker
        if raw is not None:
            reserved &= raw
        if reserved.any():
            k = int(np.argmax(reserved))
            raise BadRequest(
                field_of(*bag_position(lengths, k)),
                f"raw id {ids[k]} is reserved (the table's managed collisions mark a free slot with it)",
                "id_out_of_range",
            )


def bag_position(lengths: np.ndarray, k: int) -> tuple[int, int, int]:
    """Value index ``k`` of feature-major bags ``lengths`` [F, n] -> (feature, item, index in bag)."""
    offsets = np.cumsum(lengths.reshape(-1))
    bag = int(np.searchsorted(offsets, k, side="right"))
    f, i = divmod(bag, lengths.shape[1])
    start = int(offsets[bag - 1]) if bag else 0
    return f, i, k - start
