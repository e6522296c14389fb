"""The ranker: each candidate attends over the user's history, then an MLP scores it.

``DIN.forward(dense_features [N, D], sparse_features KJT of N rows (candidate, category),
history KJT of K rows (the user's recent items, oldest first), item_counts int64 [K])
-> logits [N, 1]`` for K requests of n_1..n_K candidates (N = sum).

Candidates and history share one item table (``t_item``, unpooled: an ``EmbeddingCollection``);
a candidate's category is pooled (``t_category``: an ``EmbeddingBagCollection``). The history is
looked up once per request, padded to ``max_sequence_length`` and repeated to the request's
candidates; each candidate weighs each history item with an attention MLP over
[candidate, item, candidate - item, candidate * item] (padding weighs 0), and the top MLP scores
[weighted history, candidate, category, dense features].
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from handlers.modeling.architecture import DENSE_INPUT, ITEM_COUNTS_INPUT, SPARSE_INPUT, Architecture
from handlers.modeling.embedding_modules import EmbeddingTables
from handlers.modeling.spec import LayerSizes, ModelSpec, Name, Pooling
from handlers.runtime.inputs import BatchKind, InputTag

from torchrec import KeyedJaggedTensor  # isort: skip
from torchrec.modules.mlp import MLP  # isort: skip

HISTORY_INPUT = "history"


class DINSpec(ModelSpec):
    """The ranker's spec: the shared item table's two features, its category table, and MLPs."""

    DENSE_SUBMODULES: ClassVar[tuple[str, ...]] = ("attention", "top")

    architecture: str = "din"
    item_table: Name = Field(description="the unpooled table the history and the candidate share")
    history_feature: Name = Field("history", description="the item table's feature sent once per request")
    candidate_feature: Name = Field("candidate", description="the item table's feature of each candidate")
    attention_mlp: LayerSizes = Field(description="hidden sizes of the attention MLP (one weight out)")
    top_mlp: LayerSizes = Field(description="top MLP sizes, ending in 1 (the logit)")

    @model_validator(mode="after")
    def _din_shaped(self) -> "DINSpec":
        tables = {t.name: t for t in self.tables}
        item = tables.get(self.item_table)
        if item is None or item.pooling != Pooling.NONE:
            raise ValueError(f"item_table: must name a table with pooling none, got {self.item_table!r}")
        if item.features != (self.history_feature, self.candidate_feature):
            raise ValueError(
                f"item_table: its features must be [{self.history_feature}, {self.candidate_feature}], "
                f"got {list(item.features)}"
            )
        if any(t.pooling == Pooling.NONE for t in self.tables if t.name != self.item_table):
            raise ValueError("tables: only the item table is unpooled")
        if self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp: last layer must be 1 (one logit), got {self.top_mlp[-1]}")
        return self

    @property
    def history_length(self) -> int:
        item = next(t for t in self.tables if t.name == self.item_table)
        return item.max_sequence_length or self.limits.max_ids_per_bag

    @property
    def item_features(self) -> tuple[str, ...]:
        """Each candidate's features: the candidate id, then the pooled tables' features."""
        pooled = tuple(f for t in self.tables if t.pooling != Pooling.NONE for f in t.features)
        return (self.candidate_feature, *pooled)


class DIN(nn.Module):
    def __init__(self, spec: DINSpec, tables: EmbeddingTables, device: torch.device) -> None:
        super().__init__()
        self.item_embeddings = tables.sequences(spec.item_table)
        self.candidate_side = nn.ModuleDict({"bags": tables.bags()})
        self.history_length = spec.history_length
        self.features = (spec.history_feature, spec.candidate_feature)
        self.pooled_features = spec.item_features[1:]
        dim = next(t.dim for t in spec.tables if t.name == spec.item_table)
        pooled_width = sum(t.dim * len(t.features) for t in spec.tables if t.pooling != Pooling.NONE)
        self.dim = dim
        self.attention = nn.Sequential(
            MLP(4 * dim, list(spec.attention_mlp), device=device),
            nn.Linear(spec.attention_mlp[-1], 1, device=device),
        )
        joined = 2 * dim + pooled_width + spec.dense_features
        hidden = list(spec.top_mlp[:-1])
        self.top = nn.Sequential(
            *([MLP(joined, hidden, device=device)] if hidden else []),
            nn.Linear(hidden[-1] if hidden else joined, 1, device=device),
        )

    def forward(
        self,
        dense_features: torch.Tensor,
        sparse_features: KeyedJaggedTensor,
        history: KeyedJaggedTensor,
        item_counts: torch.Tensor,
    ) -> torch.Tensor:
        n = dense_features.shape[0]
        candidate_ids, *pooled = sparse_features.split([1, len(self.pooled_features)])
        candidate = self._candidates(candidate_ids, n)  # [N, d]
        weighted = self._attend(candidate, history, item_counts, n)  # [N, d]
        category = self.candidate_side["bags"](pooled[0]).values()  # [N, pooled width]
        return self.top(torch.cat([weighted, candidate, category, dense_features], dim=1))

    def _lookup(self, ids: torch.Tensor, lengths: torch.Tensor, feature: int) -> torch.Tensor:
        """Unpooled rows of ``ids`` for one of the item table's two features: [len(ids), d]."""
        empty = torch.zeros_like(lengths)
        both = [lengths, empty] if feature == 0 else [empty, lengths]
        kjt = KeyedJaggedTensor(keys=list(self.features), values=ids, lengths=torch.cat(both))
        return self.item_embeddings(kjt)[self.features[feature]].values()

    def _candidates(self, candidate_ids: KeyedJaggedTensor, n: int) -> torch.Tensor:
        """Each candidate's item embedding (the sum of its ids' rows; one id in practice): [N, d]."""
        lengths = candidate_ids.lengths()
        rows = self._lookup(candidate_ids.values(), lengths, 1)
        owner = torch.repeat_interleave(torch.arange(n, device=lengths.device), lengths, output_size=rows.shape[0])
        return torch.zeros(n, self.dim, device=rows.device, dtype=rows.dtype).index_add(0, owner, rows)

    def _attend(self, candidate: torch.Tensor, history: KeyedJaggedTensor, item_counts: torch.Tensor, n: int) -> torch.Tensor:
        lengths = history.lengths()  # [K]
        rows = self._lookup(history.values(), lengths, 0)  # [sum of lengths, d]
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        padded = torch.ops.fbgemm.jagged_to_padded_dense(rows, [offsets], [self.history_length], 0.0)  # [K, T, d]
        mask = torch.arange(self.history_length, device=lengths.device)[None, :] < lengths[:, None]  # [K, T]
        padded = torch.repeat_interleave(padded, item_counts, dim=0, output_size=n)  # [N, T, d]
        mask = torch.repeat_interleave(mask, item_counts, dim=0, output_size=n)
        query = candidate[:, None, :].expand_as(padded)
        weights = self.attention(torch.cat([query, padded, query - padded, query * padded], dim=-1))
        weights = weights.squeeze(-1).masked_fill(~mask, 0.0)  # [N, T]
        return (weights[..., None] * padded).sum(dim=1)


class DINArchitecture(Architecture):
    name = "din"
    spec_type = DINSpec

    def input_tags(self, spec: DINSpec) -> tuple[InputTag, ...]:
        return (
            InputTag(DENSE_INPUT, BatchKind.ROWS),
            InputTag(SPARSE_INPUT, BatchKind.JAGGED, keys=spec.item_features),
            InputTag(HISTORY_INPUT, BatchKind.CONTEXT_JAGGED, keys=(spec.history_feature,)),
            InputTag(ITEM_COUNTS_INPUT, BatchKind.ITEM_COUNTS),
        )

    def build(self, spec: DINSpec, tables: EmbeddingTables, device: torch.device) -> nn.Module:
        return DIN(spec, tables, device)


ARCHITECTURE = DINArchitecture()
