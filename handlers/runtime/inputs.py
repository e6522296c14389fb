"""What a served model takes: its inputs with their batch tags, and the facts the decoder checks.

An architecture declares its inputs once (``handlers.modeling.architectures``); the archive tool
writes them, with the feature tables' row counts and the request limits, into the archive's
``inputs.json``. The serve-time runtime reads only that file, so a worker serving a graph never
imports the code that built the model.

Batch tags, for K requests of n_1..n_K items (N = sum):

* ``ROWS``           [n_k, D] per request      -> [N, D]
* ``JAGGED``         bags of ids per feature   -> ``JaggedIds`` with lengths [F, N] (feature-major)
* ``CONTEXT``        [1, D] once per request   -> [K, D] (the model spreads it over the items)
* ``CONTEXT_JAGGED`` ids per feature, once per request (a user's history) -> ``JaggedIds`` with
                     lengths [F, K]
* ``ITEM_COUNTS``    made by the coalescer     -> int64 [K]: n_1..n_K

A feature of a sequence table (``max_length`` set) is looked up unpooled: the model receives one
embedding per id.

Example::

    schema = InputSchema.from_file(model_dir / "inputs.json")
    schema.tags            # (InputTag("dense_features", ROWS), InputTag("sparse_features", JAGGED, keys=...))
"""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path
from typing import Any, Union

import orjson
import torch

class BatchKind(str, enum.Enum):
    ROWS = "rows"
    JAGGED = "jagged"
    CONTEXT = "context"
    CONTEXT_JAGGED = "context_jagged"
    ITEM_COUNTS = "item_counts"


@dataclasses.dataclass(frozen=True)
class InputTag:
    """How one named model input batches.

    ``keys``: the feature names of a ``JAGGED`` input.
    """

    name: str
    kind: BatchKind
    keys: tuple[str, ...] = ()


class Output(str, enum.Enum):
    """What a model answers per item: a click score, or (an embedding shard of a distributed
    layout, ``handlers.runtime.remote``) its features' pooled embeddings, flattened."""

    SCORES = "scores"
    EMBEDDINGS = "embeddings"


class OutOfRangePolicy(str, enum.Enum):
    """What happens to an id outside ``[0, rows)``: a 400, or ``id mod rows``."""

    REJECT = "reject"
    HASH = "hash"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Caps on a single request and on one forward; a request above them is a 4xx naming the field."""

    max_request_bytes: int = 6 << 20
    max_items_per_request: int = 1024
    max_ids_per_bag: int = 256
    max_items_per_forward: int = 4096


# The raw id TorchRec's MCH module marks a free slot with (int64 max): an MCH table's feature refuses it.
MCH_FREE_SLOT = (1 << 63) - 1
# The raw id TorchRec's ZCH module (FBGEMM's zero_collision_hash) marks an empty slot with: a ZCH
# table's feature refuses it (its lookup would find an empty slot as the id's).
ZCH_EMPTY_SLOT = -1
# The attribute under which a served raw-id collection keeps its remap
# (``handlers.modeling.remaps.RawIdRemaps``): its tables' slot maps end to end, and its counts.
SLOT_MAPS = "raw_id_remaps"


# A raw-id collection's running counts, which the served graph adds to: int64 [2, tables], row 0
# the unseen ids and row 1 all ids looked up, a column per raw-id table of the model (sorted by name).
RAW_ID_COUNTER = re.compile(rf"(?:^|\.){SLOT_MAPS}\.counts$")


def is_slot_map(name: str) -> bool:
    """Whether a model tensor's name is a raw-id remap's (table state, like rows), or a weights
    file's entry of a table's slot map (``slot_maps.<table>.<part>``)."""
    return f"{SLOT_MAPS}." in name or name.startswith("slot_maps.")


@dataclasses.dataclass(frozen=True)
class Feature:
    """One sparse feature and the row count of the table it looks up (its ids: ``0..rows-1``);
    ``max_length``: the most ids of one sequence, for a feature of a sequence (unpooled) table,
    else None (bags: the limits' ``max_ids_per_bag``); ``pruned_table``: the table's name where
    it is pruned (some of its ids look up a zero row: ``handlers.runtime.pruned_ids``);
    ``raw_id_table``: the table's name where its ids are raw int64 ids, mapped to rows in the
    model (``handlers.runtime.unseen_ids``): any id but ``reserved_raw_id``, the one its remap
    marks free slots with (``MCH_FREE_SLOT`` or ``ZCH_EMPTY_SLOT``); ``min_ids`` / ``max_ids``:
    the fewest and most ids one bag holds (the spec's ``ids_per_item``; None: the bag's cap)."""

    name: str
    rows: int
    max_length: int | None = None
    pruned_table: str | None = None
    raw_id_table: str | None = None
    reserved_raw_id: int | None = None
    min_ids: int = 0
    max_ids: int | None = None


@dataclasses.dataclass(frozen=True)
class InputSchema:
    """A served model's inputs, as the decoder, the coalescer and the graph runners need them.

    ``dense_features`` / ``context_features``: widths of the per-item and per-request float rows
    (0: no context); ``features``: the jagged input's features in model order; ``weighted_ids``: each
    id may carry a float weight; ``min_requests``: the fewest requests one forward takes (a graph
    with TorchAO's int8 dynamic quantization takes 2; the service pads); ``output``: scores, or
    for an embedding shard (ids only: no rows or context input) pooled embeddings, each feature's
    ``embedding_widths`` wide; ``context_sparse``: the features sent once per request (the
    ``CONTEXT_JAGGED`` input's keys), e.g. a user's history.
    """

    model: str
    tags: tuple[InputTag, ...]
    dense_features: int
    features: tuple[Feature, ...]
    context_features: int = 0
    weighted_ids: bool = False
    out_of_range: OutOfRangePolicy = OutOfRangePolicy.REJECT
    limits: Limits = Limits()
    min_requests: int = 1
    output: Output = Output.SCORES
    embedding_widths: tuple[int, ...] = ()
    context_sparse: tuple[Feature, ...] = ()

    def __post_init__(self) -> None:
        kinds = [t.kind for t in self.tags]
        if self.output == Output.EMBEDDINGS:
            if kinds != [BatchKind.JAGGED] or self.dense_features or self.context_features:
                raise ValueError("inputs: an embedding shard takes one jagged input (ids) and nothing else")
            if len(self.embedding_widths) != len(self.features):
                raise ValueError("inputs: an embedding shard gives the width of each feature's embeddings")
        elif self.embedding_widths:
            raise ValueError("inputs: embedding_widths belong to an embedding shard")
        elif kinds.count(BatchKind.ROWS) != 1 or kinds.count(BatchKind.JAGGED) != 1:
            raise ValueError(
                "inputs: the request decoder takes exactly one rows input (items' dense features) "
                f"and one jagged input (their ids), got {[k.value for k in kinds]}"
            )
        if (BatchKind.CONTEXT in kinds) != (self.context_features > 0):
            raise ValueError("inputs: a context input goes with context_features > 0, and only then")
        if kinds.count(BatchKind.CONTEXT_JAGGED) > 1:
            raise ValueError("inputs: at most one context_jagged input (the per-request ids)")
        context_ids = self.context_jagged
        if (context_ids.keys if context_ids else ()) != tuple(f.name for f in self.context_sparse):
            raise ValueError("inputs: the context_jagged input's keys must be the context_sparse features, in order")
        if BatchKind.CONTEXT_JAGGED in kinds and BatchKind.ITEM_COUNTS not in kinds:
            raise ValueError("inputs: a context_jagged input needs an item_counts input (which items are whose)")
        if self.jagged.keys != self.feature_names:
            raise ValueError("inputs: the jagged input's keys must be the features, in order")

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    @property
    def feature_rows(self) -> tuple[int, ...]:
        return tuple(f.rows for f in self.features)

    @property
    def rows(self) -> InputTag:
        """The per-item dense input."""
        return next(t for t in self.tags if t.kind == BatchKind.ROWS)

    @property
    def jagged(self) -> InputTag:
        """The per-item ids."""
        return next(t for t in self.tags if t.kind == BatchKind.JAGGED)

    @property
    def context(self) -> InputTag | None:
        return next((t for t in self.tags if t.kind == BatchKind.CONTEXT), None)

    @property
    def context_jagged(self) -> InputTag | None:
        """The per-request ids (sent once for all of a request's items), if the model takes them."""
        return next((t for t in self.tags if t.kind == BatchKind.CONTEXT_JAGGED), None)

    # -- the archive's inputs.json -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "InputSchema":
        return cls(
            model=raw["model"],
            tags=tuple(
                InputTag(t["name"], BatchKind(t["kind"]), tuple(t["keys"]))
                for t in raw["tags"]
            ),
            dense_features=raw["dense_features"],
            features=tuple(Feature(**f) for f in raw["features"]),
            context_features=raw["context_features"],
            weighted_ids=raw["weighted_ids"],
            out_of_range=OutOfRangePolicy(raw["out_of_range"]),
            limits=Limits(**raw["limits"]),
            min_requests=raw["min_requests"],
            output=Output(raw.get("output", Output.SCORES.value)),
            embedding_widths=tuple(raw.get("embedding_widths", ())),
            context_sparse=tuple(Feature(**f) for f in raw.get("context_sparse", ())),
        )

    def save(self, path: Path) -> None:
        path.write_bytes(orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2))

    @classmethod
    def from_file(cls, path: Path) -> "InputSchema":
        return cls.from_dict(orjson.loads(Path(path).read_bytes()))


@dataclasses.dataclass(frozen=True)
class JaggedIds:
    """Bags of ids: F features x n items, one request's or (coalesced) a whole batch's.

    ``lengths``: int64 [F, n], bag sizes feature-major; ``values``: int64 [lengths.sum()], the ids of
    feature 0 for items 0..n-1, then feature 1, and so on; ``weights``: float32 like ``values``, for
    a model with per-id weights, else None. This is the layout TorchRec's KeyedJaggedTensor and
    FBGEMM's lookups take, so a graph gets these tensors as they are.
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None = None

    def per_feature(self) -> tuple[torch.Tensor, ...]:
        """``values`` split by feature: F tensors, feature f's ids of every item in order."""
        return torch.split(self.values, self.lengths.sum(dim=1).tolist())


RequestTensor = Union[torch.Tensor, JaggedIds]


@dataclasses.dataclass(frozen=True)
class RequestInputs:
    """Model inputs, keyed by input name, for ``num_items`` items: one request's, or several
    consecutive requests' decoded together, whose items ``item_counts`` then gives in order."""

    num_items: int
    tensors: dict[str, RequestTensor]
    item_counts: tuple[int, ...] = ()

    @property
    def counts(self) -> tuple[int, ...]:
        """The items of each request these inputs hold."""
        return self.item_counts or (self.num_items,)
