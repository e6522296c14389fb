"""Seeded synthetic requests for a spec: example files, verification data and tests.

Ids are drawn uniformly from each feature's table; bag sizes uniformly in ``[0, max_bag]`` (multi-hot,
empty bags included). A ``context_ranker`` request carries one ``context`` row; a spec with
``weighted_ids`` gets weights in [0, 2) on about half of its bags (the rest default to 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from handlers.spec import Architecture, ModelSpec


def items_request(
    spec: ModelSpec, num_items: int, seed: int, max_bag: int = 3, return_logits: bool = False
) -> dict:
    """``{"items": [{"dense": [...], "sparse": {feature: [ids]}}]}`` with ``num_items`` items."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(num_items):
        sparse: dict[str, Any] = {}
        for feature, rows in zip(spec.feature_names, spec.feature_rows):
            bag = rng.integers(0, rows, size=int(rng.integers(0, max_bag + 1))).tolist()
            if spec.weighted_ids and rng.random() < 0.5:
                weights = rng.uniform(0, 2, size=len(bag)).round(3).tolist()
                sparse[feature] = {"ids": bag, "weights": weights}
            else:
                sparse[feature] = bag
        dense = rng.normal(size=spec.dense_features).round(4).tolist()
        items.append({"dense": dense, "sparse": sparse})
    request: dict = {"items": items}
    if spec.architecture == Architecture.CONTEXT_RANKER:
        request["context"] = rng.normal(size=spec.context_features).round(4).tolist()
    if return_logits:
        request["return_logits"] = True
    return request


def context_candidates_request(
    spec: ModelSpec,
    num_candidates: int,
    seed: int,
    candidate_features: tuple[str, ...],
    max_bag: int = 3,
) -> dict:
    """One context (user) scored against ``num_candidates`` items.

    The context's dense and sparse features repeat in every item; only ``candidate_features``
    vary per item.
    """
    base = items_request(spec, 1, seed, max_bag)["items"][0]
    rng = np.random.default_rng(seed + 1)
    rows = dict(zip(spec.feature_names, spec.feature_rows))
    items = []
    for _ in range(num_candidates):
        sparse = dict(base["sparse"])
        for feature in candidate_features:
            sparse[feature] = rng.integers(0, rows[feature], size=int(rng.integers(1, max_bag + 1))).tolist()
        items.append({"dense": base["dense"], "sparse": sparse})
    return {"items": items}
