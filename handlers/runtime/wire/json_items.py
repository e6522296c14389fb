"""The items form of a JSON request: one object per item.

    {"items": [{"dense": [13 floats], "sparse": {"cat_0": [ids...], ...}}, ...]}

A feature left out of an item is an empty bag (a 400 where the spec's ``ids_per_item.min`` needs
ids). With ``weighted_ids`` a bag is ``[ids...]`` (weights 1) or ``{"ids": [...], "weights": [...]}``.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple, Sequence

import numpy as np

from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import InputSchema
from handlers.runtime.validation import RequestChecks, bag_position
from handlers.runtime.wire.messages import DecodedRows
from handlers.runtime.wire.json_values import (
    finite_float32s,
    float_rows,
    int_array,
    json_type,
    reject_unknown,
)

ITEM_KEYS = frozenset({"dense", "sparse"})

_WEIGHTED_BAG_KEYS = frozenset({"ids", "weights"})
_EMPTY_BAG: list = []  # a feature left out of an item; only ever read
_NO_SPARSE: dict = {}  # an item without "sparse"; only ever read


class SentItems(NamedTuple):
    """One request's items as sent, checked for shape (objects, keys, feature names) but not yet
    for values: ``dense`` [n] rows, ``bags`` [n][F] (each feature's bag, ``[]`` if left out), and
    ``keys``, how many keys its item objects hold (``json_values.refuse_duplicate_keys``)."""

    dense: list[Any]
    bags: list[list[Any]]
    keys: int


class ItemsDecoder:
    """``items`` (a JSON list) -> the rows of its n items, in two steps: ``parse`` checks one
    request's shape, ``rows`` turns the items of one or more parsed requests into arrays at once
    (one set of numpy calls per TorchServe batch, not per request).

        rows = decoder.rows([decoder.parse(body["items"])])     # one request
    """

    def __init__(self, schema: InputSchema, checks: RequestChecks) -> None:
        self.schema = schema
        self.checks = checks
        self._features = schema.feature_names
        self._feature_set = frozenset(self._features)
        self._no_bags = (_EMPTY_BAG,) * len(self._features)  # per-feature defaults for dict.get

    def parse(self, items: Any) -> SentItems:
        if not isinstance(items, list) or not items:
            raise BadRequest("items", "must be a non-empty list of items")
        self.checks.item_count("items", len(items))
        features, feature_set, no_bags = self._features, self._feature_set, self._no_bags
        dense_rows: list[Any] = []
        item_bags: list[list[Any]] = []
        keys = 0
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise BadRequest(f"items[{i}]", f"must be an object, got {json_type(item)}")
            if not item.keys() <= ITEM_KEYS:
                reject_unknown(item, ITEM_KEYS, f"items[{i}].")
            if "dense" not in item:
                raise BadRequest(f"items[{i}].dense", "required", "missing_field")
            dense_rows.append(item["dense"])
            sparse = item.get("sparse", _NO_SPARSE)
            if not isinstance(sparse, dict):
                raise BadRequest(f"items[{i}].sparse", f"must be an object, got {json_type(sparse)}")
            if not sparse.keys() <= feature_set:
                raise BadRequest(f"items[{i}].sparse.{min(sparse.keys() - feature_set)}", "unknown feature")
            item_bags.append(list(map(sparse.get, features, no_bags)))
            keys += len(item) + len(sparse)
        if self.schema.weighted_ids:  # and the keys of each {"ids", "weights"} bag
            keys += sum(len(bag) for bags in item_bags for bag in bags if type(bag) is dict)
        return SentItems(dense_rows, item_bags, keys)

    def rows(self, sent: Sequence[SentItems]) -> DecodedRows:
        """The items of ``sent``, in order, as rows [N, D] and feature-major bags [F, N]. Field
        names count items from the first request's first item: exact for one request."""
        features = self._features
        dense_rows = sent[0].dense if len(sent) == 1 else [row for s in sent for row in s.dense]
        item_bags = sent[0].bags if len(sent) == 1 else [bags for s in sent for bags in s.bags]
        dense = float_rows(dense_rows, self.schema.dense_features, lambda i: f"items[{i}].dense")

        # Feature-major, as the jagged input is laid out: bag k is (feature k // n, item k % n).
        n = len(item_bags)
        bags = list(itertools.chain.from_iterable(zip(*item_bags)))
        resolved = None
        try:  # list.__len__ takes lists only: plain bags are checked and measured in one pass, in C
            lengths = np.fromiter(map(list.__len__, bags), np.int64, len(bags))
        except TypeError:  # weighted bags, or a bad one
            resolved = [
                self._bag(bag, f"items[{k % n}].sparse.{features[k // n]}") for k, bag in enumerate(bags)
            ]
            bags = [ids for ids, _ in resolved]
            lengths = np.fromiter(map(len, bags), np.int64, len(bags))
        lengths = lengths.reshape(len(features), n)
        values = list(itertools.chain.from_iterable(bags))

        def field_of(f: int, i: int, j: int | None) -> str:
            path = f"items[{i}].sparse.{features[f]}"
            if j is None:
                return path
            weighted_form = isinstance(item_bags[i][f], dict)
            return f"{path}.ids[{j}]" if weighted_form else f"{path}[{j}]"

        ids = int_array(values, lambda k: field_of(*bag_position(lengths, k)))
        ids, hashed = self.checks.ids(ids, lengths, field_of)
        weights = self._weights(resolved, lengths, len(values))
        return DecodedRows.from_arrays(dense, lengths, ids, weights, hashed)

    def _weights(
        self, resolved: list[tuple[list, list]] | None, lengths: np.ndarray, count: int
    ) -> np.ndarray | None:
        """Per-id weights of a weighted model (1 where a bag is a plain list), else None."""
        if not self.schema.weighted_ids:
            return None
        if resolved is None:
            return np.ones(count, dtype=np.float32)

        def weight_field(k: int) -> str:
            f, i, j = bag_position(lengths, k)
            return f"items[{i}].sparse.{self._features[f]}.weights[{j}]"

        flat = list(itertools.chain.from_iterable(w for _, w in resolved))
        return finite_float32s(flat, weight_field)

    def _bag(self, bag: Any, field: str) -> tuple[list[Any], list[Any]]:
        """One bag -> (ids, weights); a plain list of ids has weights of 1."""
        if isinstance(bag, list):
            return bag, [1.0] * len(bag)
        if isinstance(bag, dict) and self.schema.weighted_ids:
            reject_unknown(bag, _WEIGHTED_BAG_KEYS, f"{field}.")
            ids, weights = _list(bag, "ids", field), _list(bag, "weights", field)
            if len(weights) != len(ids):
                raise BadRequest(
                    f"{field}.weights", f"must hold one weight per id ({len(ids)}), got {len(weights)}"
                )
            return ids, weights
        expected = (
            'a list of ids or {"ids": [...], "weights": [...]}'
            if self.schema.weighted_ids
            else "a list of ids"
        )
        raise BadRequest(field, f"must be {expected}, got {json_type(bag)}")


def _list(bag: dict, key: str, field: str) -> list:
    value = bag.get(key)
    if not isinstance(value, list):
        raise BadRequest(f"{field}.{key}", f"required list, got {json_type(value)}", "missing_field")
    return value
