"""The columnar form of a JSON request: TorchRec's batch layout, as clients of TorchServe's DLRM
example send it.

    {"float_features": [[13 floats], ...],      # or flat: [13 * n floats], item after item
     "id_list_features.lengths": [F*n ints, feature-major],
     "id_list_features.values": [ids...],
     "id_list_features.weights": [floats, one per value]}     # weighted models only, optional

TorchServe's example sends one item with flat ``float_features`` (13 floats) and 26 lengths.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import InputSchema
from handlers.runtime.validation import RequestChecks, bag_position
from handlers.runtime.wire.messages import DecodedRows
from handlers.runtime.wire.json_values import finite_float32s, float_rows, int_array, json_type

DENSE_KEY = "float_features"
LENGTHS_KEY = "id_list_features.lengths"
VALUES_KEY = "id_list_features.values"
WEIGHTS_KEY = "id_list_features.weights"


class ColumnarDecoder:
    """The columnar body -> the rows of its n items."""

    def __init__(self, schema: InputSchema, checks: RequestChecks) -> None:
        self.schema = schema
        self.checks = checks
        self.keys = frozenset(
            {DENSE_KEY, LENGTHS_KEY, VALUES_KEY} | ({WEIGHTS_KEY} if schema.weighted_ids else set())
        )

    def decode(self, body: dict) -> DecodedRows:
        dense = self._dense(body[DENSE_KEY])
        num_items, num_features = dense.shape[0], len(self.schema.features)
        raw_lengths, raw_values = _list(body, LENGTHS_KEY), _list(body, VALUES_KEY)
        if len(raw_lengths) != num_features * num_items:
            raise BadRequest(
                LENGTHS_KEY,
                f"must hold {num_features} features x {num_items} items = "
                f"{num_features * num_items} lengths (feature-major), got {len(raw_lengths)}",
            )
        lengths = int_array(raw_lengths, lambda j: f"{LENGTHS_KEY}[{j}]")
        if (lengths < 0).any():
            j = int(np.argmax(lengths < 0))
            raise BadRequest(f"{LENGTHS_KEY}[{j}]", "must be >= 0")
        lengths = lengths.reshape(num_features, num_items)
        if int(lengths.sum()) != len(raw_values):
            raise BadRequest(
                VALUES_KEY, f"lengths add up to {int(lengths.sum())} ids, got {len(raw_values)}"
            )
        names = self.schema.feature_names

        def field_of(f: int, i: int, j: int | None) -> str:
            spot = f"feature {names[f]}, item {i}" + ("" if j is None else f", id {j}")
            return f"{VALUES_KEY} ({spot})"

        ids = int_array(raw_values, lambda k: field_of(*bag_position(lengths, k)))
        ids, hashed = self.checks.ids(ids, lengths, field_of)
        weights = self._weights(body, len(raw_values))
        return DecodedRows.from_arrays(dense, lengths, ids, weights, hashed)

    def _dense(self, rows: Any) -> np.ndarray:
        """Rows ``[[D floats], ...]``, or one flat list of ``D * n`` floats -> float32 [n, D]."""
        width = self.schema.dense_features
        if not isinstance(rows, list) or not rows:
            raise BadRequest(DENSE_KEY, f"must be a non-empty list of rows, or of {width} * n numbers")
        if not isinstance(rows[0], list):  # flat
            if len(rows) % width:
                raise BadRequest(
                    DENSE_KEY, f"a flat list must hold {width} numbers per item, got {len(rows)}"
                )
            self.checks.item_count(DENSE_KEY, len(rows) // width)
            flat = finite_float32s(rows, lambda k: f"{DENSE_KEY}[{k}]")
            return flat.reshape(-1, width)
        self.checks.item_count(DENSE_KEY, len(rows))
        return float_rows(rows, width, lambda i: f"{DENSE_KEY}[{i}]")

    def _weights(self, body: dict, count: int) -> np.ndarray | None:
        if not self.schema.weighted_ids:
            return None
        raw: Any = body.get(WEIGHTS_KEY, [1.0] * count)
        if not isinstance(raw, list) or len(raw) != count:
            raise BadRequest(WEIGHTS_KEY, f"must be a list of one weight per value ({count})")
        return finite_float32s(raw, lambda k: f"{WEIGHTS_KEY}[{k}]")


def _list(body: dict, key: str) -> list:
    value = body.get(key)
    if not isinstance(value, list):
        raise BadRequest(key, f"required list, got {json_type(value)}", "missing_field")
    return value
