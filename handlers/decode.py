"""The wire format, decoded in one place: JSON bytes -> ``DecodedRequest`` (typed tensors).

Two request forms are accepted (the README documents both)::

    {"items": [{"dense": [13 floats], "sparse": {"cat_0": [ids...], ...}}, ...],
     "return_logits": false}

    {"float_features": [[13 floats], ...],                 # TorchRec / TorchServe DLRM example form
     "id_list_features.lengths": [F*B ints, feature-major],
     "id_list_features.values": [ids...]}

A ``context_ranker`` also takes ``"context": [C floats]`` once per request. A model with
``weighted_ids`` takes a bag either as ``[ids...]`` (weights 1) or as ``{"ids": [...], "weights":
[...]}``, and in the columnar form an optional ``"id_list_features.weights"`` beside the values.

Anything else is a ``BadRequest`` naming the field, e.g. ``items[2].sparse.cat_4[1]``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
import orjson
import torch

from handlers.batching import JaggedIds, RequestInputs
from handlers.errors import BadRequest
from handlers.models import CONTEXT_INPUT, DENSE_INPUT, SPARSE_INPUT
from handlers.spec import Architecture, ModelSpec, OutOfRangePolicy

_ITEMS_KEYS = {"items", "return_logits"}
_COLUMNAR_KEYS = {
    "float_features",
    "id_list_features.lengths",
    "id_list_features.values",
    "return_logits",
}
_CONTEXT_KEY = "context"
_WEIGHTS_KEY = "id_list_features.weights"
_ITEM_KEYS = {"dense", "sparse"}
_WEIGHTED_BAG_KEYS = {"ids", "weights"}
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_EMPTY_BAG: list = []  # a feature left out of an item; only ever read


@dataclasses.dataclass(frozen=True)
class DecodedRequest:
    inputs: RequestInputs
    return_logits: bool


class RequestDecoder:
    """Decodes and validates requests for one spec."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._features = spec.feature_names
        self._feature_set = frozenset(self._features)
        self._feature_rows = np.asarray(spec.feature_rows, dtype=np.int64)
        self._no_bags = (_EMPTY_BAG,) * len(self._features)  # per-feature defaults for dict.get
        self._has_context = spec.architecture == Architecture.CONTEXT_RANKER
        extra = {_CONTEXT_KEY} if self._has_context else set()
        self._items_keys = _ITEMS_KEYS | extra
        self._columnar_keys = _COLUMNAR_KEYS | extra | ({_WEIGHTS_KEY} if spec.weighted_ids else set())

    def decode(self, payload: bytes | bytearray | str | dict | list | None) -> DecodedRequest:
        body = _parse_json(payload)
        if not isinstance(body, dict):
            raise BadRequest("body", f"must be a JSON object, got {_json_type(body)}")
        return_logits = body.get("return_logits", False)
        if not isinstance(return_logits, bool):
            raise BadRequest("return_logits", f"must be true or false, got {return_logits!r}")
        if "items" in body:
            _reject_unknown(body, self._items_keys, "")
            tensors = self._decode_items(body["items"])
        elif "float_features" in body:
            _reject_unknown(body, self._columnar_keys, "")
            tensors = self._decode_columnar(body)
        else:
            raise BadRequest(
                "items", "required (or the columnar form with float_features and id_list_features)"
            )
        if self._has_context:
            tensors[CONTEXT_INPUT] = self._context(body.get(_CONTEXT_KEY))
        num_items = tensors[DENSE_INPUT].shape[0]
        return DecodedRequest(RequestInputs(num_items, tensors), return_logits=return_logits)

    def _context(self, row: Any) -> torch.Tensor:
        """The request's context row -> float32 [1, C]."""
        if row is None:
            raise BadRequest(_CONTEXT_KEY, f"required: a list of {self.spec.context_features} numbers")
        return self._float_rows([row], self.spec.context_features, lambda _: _CONTEXT_KEY)

    # -- the items form ------------------------------------------------------------------------

    def _decode_items(self, items: Any) -> dict[str, Any]:
        if not isinstance(items, list) or not items:
            raise BadRequest("items", "must be a non-empty list of items")
        self._check_item_count("items", len(items))
        features = self._features
        dense_rows: list[Any] = []
        item_bags: list[list[Any]] = []  # [n][F], as sent
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise BadRequest(f"items[{i}]", f"must be an object, got {_json_type(item)}")
            _reject_unknown(item, _ITEM_KEYS, f"items[{i}].")
            if "dense" not in item:
                raise BadRequest(f"items[{i}].dense", "required")
            dense_rows.append(item["dense"])
            sparse = item.get("sparse", {})
            if not isinstance(sparse, dict):
                raise BadRequest(f"items[{i}].sparse", f"must be an object, got {_json_type(sparse)}")
            unknown = sparse.keys() - self._feature_set
            if unknown:
                raise BadRequest(f"items[{i}].sparse.{min(unknown)}", "unknown feature")
            item_bags.append(list(map(sparse.get, features, self._no_bags)))
        dense = self._float_rows(dense_rows, self.spec.dense_features, lambda i: f"items[{i}].dense")

        # Feature-major, as TorchRec lays out a KeyedJaggedTensor: bag k is (feature k // n, item k % n).
        n = len(items)
        bags = list(itertools.chain.from_iterable(zip(*item_bags)))
        resolved = None
        if not set(map(type, bags)) <= {list}:  # weighted bags, or a bad one; plain lists are checked in C
            resolved = [
                self._bag(bag, f"items[{k % n}].sparse.{features[k // n]}") for k, bag in enumerate(bags)
            ]
            bags = [ids for ids, _ in resolved]
        lengths = np.fromiter(map(len, bags), np.int64, len(bags)).reshape(len(features), n)
        values = list(itertools.chain.from_iterable(bags))
        weights = None
        if self.spec.weighted_ids and resolved is None:
            weights = np.ones(len(values), dtype=np.float32)
        elif self.spec.weighted_ids:

            def weight_field(k: int) -> str:
                f, i, j = _bag_position(lengths, k)
                return f"items[{i}].sparse.{features[f]}.weights[{j}]"

            flat_weights = list(itertools.chain.from_iterable(w for _, w in resolved))
            weights = _finite_float32s(flat_weights, weight_field)

        def field_of(f: int, i: int, j: int | None) -> str:
            path = f"items[{i}].sparse.{features[f]}"
            if j is None:
                return path
            weighted_form = isinstance(item_bags[i][f], dict)
            return f"{path}.ids[{j}]" if weighted_form else f"{path}[{j}]"

        ids = self._ids(values, lengths, field_of)
        return _sparse_and_dense(dense, lengths, ids, weights)

    def _bag(self, bag: Any, field: str) -> tuple[list[Any], list[Any]]:
        """One bag -> (ids, weights); a plain list of ids has weights of 1."""
        if isinstance(bag, list):
            return bag, [1.0] * len(bag)
        if isinstance(bag, dict) and self.spec.weighted_ids:
            _reject_unknown(bag, _WEIGHTED_BAG_KEYS, f"{field}.")
            ids, weights = bag.get("ids"), bag.get("weights")
            for key, value in (("ids", ids), ("weights", weights)):
                if not isinstance(value, list):
                    raise BadRequest(f"{field}.{key}", f"required list, got {_json_type(value)}")
            if len(weights) != len(ids):
                raise BadRequest(
                    f"{field}.weights", f"must hold one weight per id ({len(ids)}), got {len(weights)}"
                )
            return ids, weights
        expected = (
            'a list of ids or {"ids": [...], "weights": [...]}'
            if self.spec.weighted_ids
            else "a list of ids"
        )
        raise BadRequest(field, f"must be {expected}, got {_json_type(bag)}")

    # -- the columnar (TorchRec) form ----------------------------------------------------------

    def _decode_columnar(self, body: dict) -> dict[str, Any]:
        rows = body["float_features"]
        if not isinstance(rows, list) or not rows:
            raise BadRequest("float_features", "must be a non-empty list of rows")
        self._check_item_count("float_features", len(rows))
        dense = self._float_rows(rows, self.spec.dense_features, lambda i: f"float_features[{i}]")
        num_items, num_features = len(rows), len(self._features)
        raw_lengths = body.get("id_list_features.lengths")
        raw_values = body.get("id_list_features.values")
        for name, value in (
            ("id_list_features.lengths", raw_lengths),
            ("id_list_features.values", raw_values),
        ):
            if not isinstance(value, list):
                raise BadRequest(name, f"required list, got {_json_type(value)}")
        if len(raw_lengths) != num_features * num_items:
            raise BadRequest(
                "id_list_features.lengths",
                f"must hold {num_features} features x {num_items} items = "
                f"{num_features * num_items} lengths (feature-major), got {len(raw_lengths)}",
            )
        lengths = _int_array(raw_lengths, lambda j: f"id_list_features.lengths[{j}]")
        if (lengths < 0).any():
            j = int(np.argmax(lengths < 0))
            raise BadRequest(f"id_list_features.lengths[{j}]", "must be >= 0")
        lengths = lengths.reshape(num_features, num_items)
        if int(lengths.sum()) != len(raw_values):
            raise BadRequest(
                "id_list_features.values",
                f"lengths add up to {int(lengths.sum())} ids, got {len(raw_values)}",
            )
        ids = self._ids(
            raw_values,
            lengths,
            lambda f, i, j: f"id_list_features.values (feature {self._features[f]}, item {i}"
            + ("" if j is None else f", id {j}")
            + ")",
        )
        weights = None
        if self.spec.weighted_ids:
            raw_weights = body.get(_WEIGHTS_KEY, [1.0] * len(raw_values))
            if not isinstance(raw_weights, list) or len(raw_weights) != len(raw_values):
                raise BadRequest(
                    _WEIGHTS_KEY, f"must be a list of one weight per value ({len(raw_values)})"
                )
            weights = _finite_float32s(raw_weights, lambda k: f"{_WEIGHTS_KEY}[{k}]")
        return _sparse_and_dense(dense, lengths, ids, weights)

    # -- shared checks -------------------------------------------------------------------------

    def _check_item_count(self, field: str, count: int) -> None:
        cap = self.spec.limits.max_items_per_request
        if count > cap:
            raise BadRequest(field, f"{count} items exceed the limit of {cap} per request")

    def _float_rows(self, rows: list[Any], width: int, field_of: Any) -> torch.Tensor:
        """[n] rows of ``width`` finite numbers -> float32 [n, width]."""
        for i, row in enumerate(rows):
            if not isinstance(row, list):
                raise BadRequest(field_of(i), f"must be a list of {width} numbers, got {_json_type(row)}")
            if len(row) != width:
                raise BadRequest(field_of(i), f"must hold {width} numbers, got {len(row)}")
        flat = [v for row in rows for v in row]
        values = _finite_float32s(flat, lambda k: f"{field_of(k // width)}[{k % width}]")
        return torch.from_numpy(values.reshape(len(rows), width))

    def _ids(self, values: list[Any], lengths: np.ndarray, field_of: Any) -> np.ndarray:
        """Validates ids against bag caps and table rows; applies the out-of-range policy.

        ``lengths``: [F, n]; ``values``: ids feature-major; ``field_of(f, item, id_index)`` names a spot.
        """
        cap = self.spec.limits.max_ids_per_bag
        if lengths.size and lengths.max() > cap:
            f, i = np.unravel_index(int(np.argmax(lengths)), lengths.shape)
            raise BadRequest(
                field_of(int(f), int(i), None),
                f"{int(lengths[f, i])} ids exceed the limit of {cap} per bag",
            )

        def locate(k: int) -> str:
            return field_of(*_bag_position(lengths, k))

        ids = _int_array(values, locate)
        if (ids < 0).any():
            k = int(np.argmax(ids < 0))
            raise BadRequest(locate(k), f"ids must be >= 0, got {values[k]}")
        rows = np.repeat(self._feature_rows, lengths.sum(axis=1))
        beyond = ids >= rows
        if beyond.any():
            if self.spec.out_of_range == OutOfRangePolicy.HASH:
                ids = np.where(beyond, ids % rows, ids)
            else:
                k = int(np.argmax(beyond))
                raise BadRequest(
                    locate(k), f"id {values[k]} is outside the table's {int(rows[k])} rows"
                )
        return ids


def _bag_position(lengths: np.ndarray, k: int) -> tuple[int, int, int]:
    """Value index ``k`` of feature-major bags ``lengths`` [F, n] -> (feature, item, index in bag)."""
    offsets = np.cumsum(lengths.reshape(-1))
    bag = int(np.searchsorted(offsets, k, side="right"))
    f, i = divmod(bag, lengths.shape[1])
    start = int(offsets[bag - 1]) if bag else 0
    return f, i, k - start


def _sparse_and_dense(
    dense: torch.Tensor, lengths: np.ndarray, ids: np.ndarray, weights: np.ndarray | None
) -> dict[str, Any]:
    return {
        DENSE_INPUT: dense,
        SPARSE_INPUT: JaggedIds(
            lengths=torch.from_numpy(lengths),
            values=torch.from_numpy(ids.astype(np.int64)),
            weights=None if weights is None else torch.from_numpy(weights),
        ),
    }


def _finite_float32s(flat: list[Any], locate: Any) -> np.ndarray:
    """JSON numbers -> float32 array; non-numbers and values beyond float32 are a ``BadRequest``."""
    if not set(map(type, flat)) <= {int, float}:
        k = next(k for k, v in enumerate(flat) if type(v) not in (int, float))
        raise BadRequest(locate(k), f"must be a number, got {flat[k]!r}")
    try:
        with np.errstate(over="ignore"):  # beyond float32 becomes inf, refused below
            values = np.array(flat, dtype=np.float64).astype(np.float32)
    except OverflowError:  # an integer beyond float64
        values = None
    if values is None or not np.isfinite(values).all():
        k = next(k for k, v in enumerate(flat) if not _finite_float32(v))
        raise BadRequest(locate(k), f"must be finite in float32, got {flat[k]!r}")
    return values


def _int_array(values: list[Any], locate: Any) -> np.ndarray:
    """JSON integers -> int64 array; bools, floats, strings and huge ints are a ``BadRequest``."""
    if not set(map(type, values)) <= {int}:
        k = next(k for k, v in enumerate(values) if type(v) is not int)
        raise BadRequest(locate(k), f"must be an integer id, got {values[k]!r}")
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        k = next(k for k, v in enumerate(values) if not -(2**63) <= v < 2**63)
        raise BadRequest(locate(k), f"integer {values[k]} is out of int64 range") from None


def _finite_float32(value: int | float) -> bool:
    """Exact for ints of any size; False for NaN and infinities."""
    return abs(value) <= _FLOAT32_MAX


def _parse_json(payload: Any) -> Any:
    """Strict JSON: NaN and Infinity are malformed. A payload that TorchServe already decoded
    (``decode_input_request=true``) may hold them; the finite checks on values catch them."""
    if isinstance(payload, (bytes, bytearray, memoryview, str)):
        try:
            return orjson.loads(payload)
        except orjson.JSONDecodeError as e:
            raise BadRequest("body", f"malformed JSON: {e}") from None
    if payload is None:
        raise BadRequest("body", "empty request body")
    return payload


def _reject_unknown(obj: dict, allowed: set[str], prefix: str) -> None:
    unknown = obj.keys() - allowed
    if unknown:
        raise BadRequest(f"{prefix}{sorted(unknown)[0]}", "unknown field")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "NaN" if isinstance(value, float) and math.isnan(value) else "number"
    return {dict: "object", list: "array", str: "string", type(None): "null"}.get(
        type(value), type(value).__name__
    )
