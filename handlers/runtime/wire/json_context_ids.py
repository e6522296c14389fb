"""The ids a JSON request sends once for all its items (a model with per-request sparse features,
e.g. a user's history), in the items and the columnar forms alike:

    {"items": [...], "context_sparse": {"history": [ids, oldest first, ...]}}

A feature left out is an empty sequence (valid: a new user has no history, unless the spec's
``ids_per_item.min`` says otherwise). Each feature's ids are checked like the items' (table rows,
the out-of-range policy, the feature's ``max_length`` and id counts), and errors name them:
``context_sparse.history[3]``.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np

from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import InputSchema, JaggedIds
from handlers.runtime.validation import RequestChecks, bag_position
from handlers.runtime.wire.json_values import int_array, json_type
from handlers.runtime.wire.messages import as_tensor

CONTEXT_SPARSE_KEY = "context_sparse"


class ContextIdsDecoder:
    """``context_sparse`` of one request -> its sequences (``parse``); those of K requests -> the
    per-request jagged input, lengths [F, K] (``jagged``)."""

    def __init__(self, schema: InputSchema, checks: RequestChecks) -> None:
        self.features = tuple(f.name for f in schema.context_sparse)
        self.checks = checks
        self._known = frozenset(self.features)

    def parse(self, raw: Any) -> list[list[Any]]:
        """One request's sequences, one list per feature (``[]`` where left out)."""
        if raw is None:
            return [[] for _ in self.features]
        if not isinstance(raw, dict):
            raise BadRequest(CONTEXT_SPARSE_KEY, f"must be an object of feature: [ids], got {json_type(raw)}")
        if not raw.keys() <= self._known:
            unknown = min(raw.keys() - self._known)
            raise BadRequest(f"{CONTEXT_SPARSE_KEY}.{unknown}", "unknown feature", "unknown_field")
        sequences = [raw.get(name, []) for name in self.features]
        for name, ids in zip(self.features, sequences):
            if not isinstance(ids, list):
                raise BadRequest(f"{CONTEXT_SPARSE_KEY}.{name}", f"must be a list of ids, got {json_type(ids)}")
        return sequences

    def jagged(self, requests: Sequence[list[list[Any]]]) -> tuple[JaggedIds, int]:
        """The per-request ids of ``requests`` (each ``parse``'s result), feature-major, and how
        many the out-of-range policy hashed. Field names count from the first request."""
        by_feature = list(zip(*requests))  # [F][K] sequences
        lengths = np.array([[len(s) for s in sequences] for sequences in by_feature], dtype=np.int64)
        lengths = lengths.reshape(len(self.features), len(requests))
        values = list(itertools.chain.from_iterable(itertools.chain.from_iterable(by_feature)))

        def field_of(f: int, k: int, j: int | None) -> str:
            where = f"{CONTEXT_SPARSE_KEY}.{self.features[f]}"
            return where if j is None else f"{where}[{j}]"

        ids = int_array(values, lambda v: field_of(*bag_position(lengths, v)))
        ids, hashed = self.checks.context_ids(ids, lengths, field_of)
        return JaggedIds(lengths=as_tensor(lengths), values=as_tensor(ids)), hashed
