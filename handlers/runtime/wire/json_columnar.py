"""The columnar form of a JSON request: TorchRec's batch layout, as clients of TorchServe's DLRM
example send it.

    {"float_features": [[13 floats], ...],      # or flat: [13 * n floats], item after item
     "id_list_features.lengths": [F*n ints, feature-major],
     "id_list_features.values": [ids...],
     "id_list_features.weights": [floats, one per value]}     # weighted models only, optional

TorchServe's example sends one item with flat ``float_features`` (13 floats) and 26 lengths.

Like the items form, a request is read in two steps: ``parse`` checks one request's shape,
``rows`` makes the arrays of one or more parsed requests at once, so that a TorchServe batch of
32 one-item requests pays one set of numpy calls, not 32 (each request's own calls were most of
its decoding, and a forward's 32 parts then cost a coalescing of 32).

    rows = decoder.rows([decoder.parse(body)])     # one request
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple, Sequence

import numpy as np

from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import InputSchema
from handlers.runtime.validation import RequestChecks, bag_position
from handlers.runtime.wire.messages import DecodedRows
from handlers.runtime.wire.json_values import check_row_shapes, finite_float32s, int_array, json_type

DENSE_KEY = "float_features"
LENGTHS_KEY = "id_list_features.lengths"
VALUES_KEY = "id_list_features.values"
WEIGHTS_KEY = "id_list_features.weights"


class SentColumns(NamedTuple):
    """One columnar request as sent, checked for shape but not yet for values: ``dense`` its
    numbers, flat (D per item, item after item; ``flat``) or as n rows; ``lengths`` [F*n]
    feature-major; ``values`` the ids; ``weights`` as sent (None: left out)."""

    dense: list[Any]
    flat: bool
    lengths: list[Any]
    values: list[Any]
    weights: Any
    num_items: int


class ColumnarDecoder:
    """The columnar body -> the rows of its n items."""

    def __init__(self, schema: InputSchema, checks: RequestChecks) -> None:
        self.schema = schema
        self.checks = checks
        self.keys = frozenset(
            {DENSE_KEY, LENGTHS_KEY, VALUES_KEY} | ({WEIGHTS_KEY} if schema.weighted_ids else set())
        )
        self._names = schema.feature_names
        self._width = schema.dense_features

    def parse(self, body: dict) -> SentColumns:
        """Checks the body's shape: dense rows (or a flat list of D * n numbers), F * n lengths."""
        dense, flat, num_items = self._dense(body.get(DENSE_KEY))
        lengths, values = _list(body, LENGTHS_KEY), _list(body, VALUES_KEY)
        num_features = len(self._names)
        if len(lengths) != num_features * num_items:
            raise BadRequest(
                LENGTHS_KEY,
                f"must hold {num_features} features x {num_items} items = "
                f"{num_features * num_items} lengths (feature-major), got {len(lengths)}",
            )
        return SentColumns(dense, flat, lengths, values, body.get(WEIGHTS_KEY), num_items)

    def rows(self, sent: Sequence[SentColumns]) -> DecodedRows:
        """The items of ``sent``, in order, as rows [N, D] and feature-major bags [F, N]. Field
        names count items and values from the first request's first: exact for one request."""
        width, num_features = self._width, len(self._names)
        one = sent[0] if len(sent) == 1 else None
        if one is not None and one.flat:
            flat_dense = one.dense
        else:
            flat_dense = [v for s in sent for v in (s.dense if s.flat else itertools.chain.from_iterable(s.dense))]

        def dense_field(k: int) -> str:
            return f"{DENSE_KEY}[{k}]" if sent[0].flat else f"{DENSE_KEY}[{k // width}][{k % width}]"

        dense = finite_float32s(flat_dense, dense_field).reshape(-1, width)
        raw_lengths = one.lengths if one is not None else [n for s in sent for n in s.lengths]
        lengths = int_array(raw_lengths, lambda j: f"{LENGTHS_KEY}[{j}]")
        if (lengths < 0).any():
            j = int(np.argmax(lengths < 0))
            raise BadRequest(f"{LENGTHS_KEY}[{j}]", "must be >= 0")
        _refuse_unmatched_values(lengths, sent)
        raw_values = one.values if one is not None else [i for s in sent for i in s.values]
        names = self._names

        def field_of(f: int, i: int, j: int | None) -> str:
            spot = f"feature {names[f]}, item {i}" + ("" if j is None else f", id {j}")
            return f"{VALUES_KEY} ({spot})"

        order = None
        if one is not None:
            lengths = lengths.reshape(num_features, one.num_items)
        else:
            lengths, order = _feature_major(lengths, [s.num_items for s in sent], num_features)
        ids = int_array(raw_values, lambda k: field_of(*bag_position(lengths, k)))
        if order is not None:
            ids = ids[order]
        ids, hashed = self.checks.ids(ids, lengths, field_of)
        weights = self._weights(sent, order)
        return DecodedRows.from_arrays(dense, lengths, ids, weights, hashed)

    def _dense(self, rows: Any) -> tuple[list[Any], bool, int]:
        """Rows ``[[D numbers], ...]``, or one flat list of ``D * n`` numbers: (the list, whether
        flat, n), checked for shape only."""
        width = self._width
        if not isinstance(rows, list) or not rows:
            raise BadRequest(DENSE_KEY, f"must be a non-empty list of rows, or of {width} * n numbers")
        if not isinstance(rows[0], list):  # flat
            if len(rows) % width:
                raise BadRequest(
                    DENSE_KEY, f"a flat list must hold {width} numbers per item, got {len(rows)}"
                )
            self.checks.item_count(DENSE_KEY, len(rows) // width)
            return rows, True, len(rows) // width
        self.checks.item_count(DENSE_KEY, len(rows))
        check_row_shapes(rows, width, lambda i: f"{DENSE_KEY}[{i}]")
        return rows, False, len(rows)

    def _weights(self, sent: Sequence[SentColumns], order: np.ndarray | None) -> np.ndarray | None:
        """A weighted model's per-value weights (1 where a request left them out), in the order
        of the ids; None for an unweighted model."""
        if not self.schema.weighted_ids:
            return None
        raw: list[Any] = []
        for s in sent:
            weights: Any = [1.0] * len(s.values) if s.weights is None else s.weights
            if not isinstance(weights, list) or len(weights) != len(s.values):
                raise BadRequest(WEIGHTS_KEY, f"must be a list of one weight per value ({len(s.values)})")
            raw += weights
        values = finite_float32s(raw, lambda k: f"{WEIGHTS_KEY}[{k}]")
        return values if order is None else values[order]


def _refuse_unmatched_values(lengths: np.ndarray, sent: Sequence[SentColumns]) -> None:
    """A ``BadRequest`` when a request's lengths do not add up to its number of values."""
    if len(sent) == 1:
        sums = [int(lengths.sum())]
    else:
        sizes = np.asarray([len(s.lengths) for s in sent])
        ends = np.cumsum(sizes)
        running = np.concatenate(([0], np.cumsum(lengths)))
        sums = (running[ends] - running[ends - sizes]).tolist()
    for total, s in zip(sums, sent):
        if total != len(s.values):
            raise BadRequest(VALUES_KEY, f"lengths add up to {total} ids, got {len(s.values)}")


def _feature_major(
    lengths: np.ndarray, counts: list[int], num_features: int
) -> tuple[np.ndarray, np.ndarray]:
    """Several requests' lengths, each [F * n_r] feature-major, one after another -> the bags of
    all their items [F, N] feature-major, and the order that takes their values (request after
    request) to the same layout: ``values[order]``."""
    n = np.asarray(counts, dtype=np.int64)
    total = int(n.sum())
    owner = np.repeat(np.arange(len(counts)), n)  # each item's request
    first = (np.cumsum(n) - n)[owner]  # the index of its request's first item
    # bag (f, item g) of request r sits at F * first + f * n_r + (g - first) in the sent lengths
    within = np.arange(total) - first  # its index in its request
    source = num_features * first + np.arange(num_features)[:, None] * n[owner] + within
    bags = lengths[source]
    starts = np.cumsum(lengths) - lengths  # each sent bag's first value
    flat_source, flat_bags = source.reshape(-1), bags.reshape(-1)
    laid_out = np.cumsum(flat_bags) - flat_bags  # each bag's first value, laid out
    order = np.repeat(starts[flat_source] - laid_out, flat_bags) + np.arange(int(flat_bags.sum()))
    return bags, order


def _list(body: dict, key: str) -> list:
    value = body.get(key)
    if not isinstance(value, list):
        raise BadRequest(key, f"required list, got {json_type(value)}", "missing_field")
    return value
