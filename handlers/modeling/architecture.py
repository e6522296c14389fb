"""The architecture contract: what a model family gives the project so that it can be built,
captured, verified and served. It is public and versioned (``CONTRACT_VERSION``; every archive
records the version it was built with); the shipped architectures implement it like anyone else.

A spec names its architecture by a registered name (the ``torchrec_serve.architectures`` entry
point group: ``architecture: dlrm``) or by import path (``architecture: my_models.din:DIN``, a
module attribute that is an ``Architecture`` instance or subclass). A minimal one::

    class TwoTowerSpec(ModelSpec):
        tower: LayerSizes

    class TwoTower(Architecture):
        name = "two_tower"
        spec_type = TwoTowerSpec

        def input_tags(self, spec):              # forward's parameters, in order, and how they batch
            return per_item_tags(spec)           # dense_features [N, D], sparse_features (KJT)

        def build(self, spec, tables, device):   # the float model; tables come from ``tables``
            return TwoTowerModel(tables.bags(), spec.dense_features, spec.tower, device)

    ARCHITECTURE = TwoTower()

``build`` makes the whole model; its embedding modules (any number of TorchRec
``EmbeddingBagCollection`` / ``EmbeddingCollection``, at any path) come from ``tables``
(``handlers.modeling.embedding_modules.EmbeddingTables``), which puts them on the device the
factory asks for; the factory finds them, quantizes each table to the spec's dtype and shares
them between workers. ``forward`` takes the inputs ``input_tags`` declares, by those names, in that
order (checked at build), and returns logits [N, 1]. ``split`` is optional: without it, the
``split`` artifact and the distributed layout are refused for the architecture.

What the runtime assumes of ``forward``: each item's score depends on that item (and its
request's context) alone, so requests batched together score as they would alone, and a padding
item (zero dense row, each bag holding its feature's ``ids_per_item.min`` ids of id 0, sent where a
graph needs more items or some id) changes no other item's score. A model that takes exactly one id
of a feature says so in the spec (``ids_per_item: {min: 1, max: 1}`` on the table, or per feature
in ``ids_per_feature``): requests are then held to it, and so are the build's synthetic requests.
Where a model needs requests the spec cannot describe (ids that must relate across features, say),
override ``synthetic_request``, which the build captures and verifies the model on::

    class Pairs(TwoTower):
        def synthetic_request(self, spec, num_items, seed, max_bag=3, return_logits=False, owned_ids=None):
            request = super().synthetic_request(spec, num_items, seed, max_bag, return_logits, owned_ids)
            for item in request["items"]:                  # the pair's second id repeats its first
                item["sparse"]["item_b"] = item["sparse"]["item_a"]
            return request
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Mapping

import numpy as np
import torch
from torch import nn

from handlers.modeling.embedding_modules import EmbeddingTables
from handlers.modeling.errors import SpecError
from handlers.modeling.remap_spec import RESERVED_RAW_ID, IdSpace
from handlers.modeling.spec import ModelSpec, Pooling
from handlers.runtime.inputs import MCH_FREE_SLOT, BatchKind, Feature, InputSchema, InputTag

# The contract's version: raised when a change would break architectures written for the last one.
CONTRACT_VERSION = 1

DENSE_INPUT = "dense_features"
SPARSE_INPUT = "sparse_features"
CONTEXT_INPUT = "context_features"
ITEM_COUNTS_INPUT = "item_counts"


class Architecture(abc.ABC):
    """One model family. ``name`` names it in messages; ``spec_type`` parses its specs;
    ``contract_version``: the contract it was written for."""

    name: ClassVar[str]
    spec_type: ClassVar[type[ModelSpec]]
    contract_version: ClassVar[int] = CONTRACT_VERSION

    @abc.abstractmethod
    def input_tags(self, spec: Any) -> tuple[InputTag, ...]:
        """The model's forward inputs, in forward order, and how each batches."""

    @abc.abstractmethod
    def build(self, spec: Any, tables: EmbeddingTables, device: torch.device) -> nn.Module:
        """The float model: embedding modules from ``tables``, everything else on ``device``."""

    def split(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """``model`` as (sparse part, dense part), sharing its modules: ``model(*inputs) ==
        dense(*others, sparse(ids))`` with the inputs in ``handlers.runtime.split``'s tag order.
        Optional; the default refuses."""
        raise NotImplementedError(f"architecture {self.name} does not split into lookups and a dense part")

    @property
    def splits(self) -> bool:
        return type(self).split is not Architecture.split

    def context_features(self, spec: Any) -> int:
        """Width of the per-request context row (0: the model has no context input)."""
        return 0

    def input_schema(self, spec: Any) -> InputSchema:
        """What the runtime needs to decode and batch requests for this model (``inputs.json``):
        the items' features are the jagged input's keys, the per-request ones (if any) the
        context_jagged input's."""
        tags = self.input_tags(spec)
        features = _features(spec)
        if [t.kind for t in tags].count(BatchKind.JAGGED) != 1:
            raise SpecError(f"architecture {spec.architecture}: its inputs must hold one jagged input (the items' ids)")
        item_keys = next(t.keys for t in tags if t.kind == BatchKind.JAGGED)
        context_keys = next((t.keys for t in tags if t.kind == BatchKind.CONTEXT_JAGGED), ())
        unused = [f for f in features if f not in item_keys + context_keys]
        unknown = [f for f in item_keys + context_keys if f not in features]
        if unused or unknown:
            raise SpecError(
                f"architecture {spec.architecture}: its inputs' keys and the spec's features differ "
                f"(features no input takes: {unused}; keys no table serves: {unknown})"
            )
        try:
            return InputSchema(
                model=spec.name,
                tags=tags,
                dense_features=spec.dense_features,
                features=tuple(features[f] for f in item_keys),
                context_features=self.context_features(spec),
                weighted_ids=spec.weighted_ids,
                out_of_range=spec.out_of_range,
                limits=spec.limits.to_limits(),
                min_requests=spec.min_requests,
                context_sparse=tuple(features[f] for f in context_keys),
            )
        except ValueError as e:  # the runtime's own checks of the declared inputs
            raise SpecError(f"architecture {spec.architecture}: {e}") from None

    def synthetic_request(
        self, spec: Any, num_items: int, seed: int, max_bag: int = 3, return_logits: bool = False,
        owned_ids: Mapping[str, torch.Tensor] | None = None,
    ) -> dict:
        """A seeded JSON request of ``num_items`` items: dense rows normal, ids uniform over each
        table (a raw-id table's: 3 in 4 drawn from its ``owned_ids`` where given, the raw ids that
        own its slots in any order, the others anywhere in int64), bags of 0..``max_bag`` ids
        (within each feature's ``ids_per_item``), weights in [0, 2) on about half the bags of a
        weighted model, a context row where the model takes one, and per-request sequences of
        0..4 x ``max_bag`` ids (within each feature's cap and ``ids_per_item``) where it takes them.
        The build captures and verifies the model on such requests; override it where the model
        needs requests that the spec cannot describe (module docstring)."""
        rng = np.random.default_rng(seed)
        schema = self.input_schema(spec)
        owned = {
            feature: ids[ids != MCH_FREE_SLOT].numpy()
            for table in spec.tables if (ids := (owned_ids or {}).get(table.name)) is not None
            for feature in table.features
        }
        items = []
        for _ in range(num_items):
            sparse: dict[str, Any] = {}
            for feature in schema.features:
                bag = _draw_ids(rng, feature, _bag_size(rng, feature, max_bag), owned.get(feature.name))
                if spec.weighted_ids and rng.random() < 0.5:
                    weights = rng.uniform(0, 2, size=len(bag)).round(3).tolist()
                    sparse[feature.name] = {"ids": bag, "weights": weights}
                else:
                    sparse[feature.name] = bag
            items.append({"dense": rng.normal(size=spec.dense_features).round(4).tolist(), "sparse": sparse})
        request: dict = {"items": items}
        if self.context_features(spec):
            request["context"] = rng.normal(size=self.context_features(spec)).round(4).tolist()
        if schema.context_sparse:
            request["context_sparse"] = {
                f.name: rng.integers(0, f.rows, size=_bag_size(rng, f, 4 * max_bag)).tolist()
                for f in schema.context_sparse
            }
        if return_logits:
            request["return_logits"] = True
        return request


def _bag_size(rng: np.random.Generator, feature: Feature, max_bag: int) -> int:
    """A bag's size, uniform over what ``feature`` takes (``min_ids`` to ``max_ids`` or its
    sequence's cap) within ``max_bag``, never below ``min_ids``."""
    most = min(max_bag, feature.max_ids or max_bag, feature.max_length or max_bag)
    return int(rng.integers(feature.min_ids, max(most, feature.min_ids) + 1))


def _draw_ids(rng: np.random.Generator, feature: Feature, size: int, owned: np.ndarray | None) -> list[int]:
    """``size`` ids of ``feature``: uniform over its rows, or for raw ids 3 in 4 from ``owned``
    (where given) and the others uniform over int64 (unseen, but for a rare chance)."""
    if feature.raw_id_table is None:
        return rng.integers(0, feature.rows, size=size).tolist()
    anywhere = rng.integers(-(2**63), MCH_FREE_SLOT, size=size, dtype=np.int64)
    if owned is None or not len(owned):
        return anywhere.tolist()
    return np.where(rng.random(size) < 0.75, owned[rng.integers(0, len(owned), size=size)], anywhere).tolist()


def _features(spec: Any) -> dict[str, Feature]:
    """Every spec feature with its table's rows and, for a sequence table, its cap."""
    found = {}
    for table in spec.tables:
        cap = None
        if table.pooling == Pooling.NONE:
            cap = table.max_sequence_length or spec.limits.max_ids_per_bag
        for name in table.features:
            raw = table.name if table.ids == IdSpace.RAW else None
            reserved = None if table.remap is None else RESERVED_RAW_ID[table.remap.kind]
            counts = table.ids_of(name)
            pruned = table.name if table.pruned_to else None
            found[name] = Feature(name, table.rows, cap, pruned, raw, reserved, counts.min, counts.max)
    return found


def per_item_tags(spec: Any) -> tuple[InputTag, ...]:
    """The inputs of a model that scores items alone: dense rows and bags of ids."""
    return (
        InputTag(DENSE_INPUT, BatchKind.ROWS),
        InputTag(SPARSE_INPUT, BatchKind.JAGGED, keys=spec.feature_names),
    )
