"""What an architecture is: one module per model family declares its spec section, its inputs
with their batch tags, its float and inference models and how they split, and its synthetic data.
Everything else asks the registry (``handlers.modeling.registry``).

To add an architecture, write ``handlers/modeling/architectures/<name>.py`` defining a
``ModelSpec`` subclass and an ``Architecture`` subclass, with ``ARCHITECTURE = YourArchitecture()``;
the registry finds it, the spec parser, the archive tool, the handler and the benchmarks then
serve it. Its embedding tables must sit at ``EBC_PATH`` (the factory quantizes and shards them
there).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from handlers.modeling.spec import ModelSpec
from handlers.runtime.inputs import BatchKind, Feature, InputSchema, InputTag

DENSE_INPUT = "dense_features"
SPARSE_INPUT = "sparse_features"
CONTEXT_INPUT = "context_features"
ITEM_COUNTS_INPUT = "item_counts"

# Where the embedding tables live in every architecture (the factory swaps and shards them there).
EBC_PATH = "sparse_arch.embedding_bag_collection"


class Architecture(abc.ABC):
    """One model family. ``name`` is the spec's ``architecture`` value; ``spec_type`` parses it."""

    name: ClassVar[str]
    spec_type: ClassVar[type[ModelSpec]]

    @abc.abstractmethod
    def input_tags(self, spec: Any) -> tuple[InputTag, ...]:
        """The model's forward inputs, in forward order, and how each batches."""

    @abc.abstractmethod
    def build(self, spec: Any, ebc: nn.Module, device: torch.device) -> nn.Module:
        """The model around ``ebc`` (float, on meta, or quantized), dense layers on ``device``."""

    @abc.abstractmethod
    def split(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """``model`` as (sparse part, dense part), sharing its modules: ``model(*inputs) ==
        dense(*others, sparse(ids))`` with the inputs in ``handlers.runtime.split``'s tag order."""

    def context_features(self, spec: Any) -> int:
        """Width of the per-request context row (0: the model has no context input)."""
        return 0

    def input_schema(self, spec: Any) -> InputSchema:
        """What the runtime needs to decode and batch requests for this model (``inputs.json``)."""
        return InputSchema(
            model=spec.name,
            tags=self.input_tags(spec),
            dense_features=spec.dense_features,
            features=tuple(Feature(n, r) for n, r in zip(spec.feature_names, spec.feature_rows)),
            context_features=self.context_features(spec),
            weighted_ids=spec.weighted_ids,
            out_of_range=spec.out_of_range,
            limits=spec.limits.to_limits(),
            min_requests=spec.min_requests,
        )

    def synthetic_request(
        self, spec: Any, num_items: int, seed: int, max_bag: int = 3, return_logits: bool = False
    ) -> dict:
        """A seeded JSON request of ``num_items`` items: dense rows normal, ids uniform over each
        table, bags of 0..``max_bag`` ids, weights in [0, 2) on about half the bags of a weighted
        model, and a context row where the model takes one."""
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
            items.append({"dense": rng.normal(size=spec.dense_features).round(4).tolist(), "sparse": sparse})
        request: dict = {"items": items}
        if self.context_features(spec):
            request["context"] = rng.normal(size=self.context_features(spec)).round(4).tolist()
        if return_logits:
            request["return_logits"] = True
        return request


def per_item_tags(spec: Any) -> tuple[InputTag, ...]:
    """The inputs of a model that scores items alone: dense rows and bags of ids."""
    return (
        InputTag(DENSE_INPUT, BatchKind.ROWS),
        InputTag(SPARSE_INPUT, BatchKind.JAGGED, keys=spec.feature_names),
    )
