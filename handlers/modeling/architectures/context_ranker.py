"""``context_ranker``: scores a request's candidates against its context (e.g. one user, 100 items).

``forward(dense_features [N, D], sparse_features KJT of N rows, context_features [K, C],
item_counts int64 [K]) -> logits [N, 1]`` for K requests of n_1..n_K items (N = sum).

The context MLP runs once per request ([K, C] -> [K, c]); its output is repeated to the request's
items and joined with each candidate's dense MLP output and pooled embeddings for the top MLP.
Spec keys: ``bottom_mlp`` (candidate dense MLP), ``context_features``, ``context_mlp``,
``top_mlp``; tables may have dims of their own.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Sequence

import torch
from pydantic import Field, model_validator
from torch import nn

from handlers.modeling.architecture import (
    CONTEXT_INPUT,
    ITEM_COUNTS_INPUT,
    Architecture,
    per_item_tags,
)
from handlers.modeling.embedding_modules import EmbeddingTables
from handlers.modeling.spec import LayerSizes, ModelSpec, PositiveInt
from handlers.runtime.inputs import BatchKind, InputTag

from torchrec import KeyedJaggedTensor  # isort: skip
from torchrec.modules.mlp import MLP  # isort: skip


class ContextRankerSpec(ModelSpec):
    DENSE_SUBMODULES: ClassVar[tuple[str, ...]] = ("dense_arch", "context_arch", "over_arch")

    architecture: Literal["context_ranker"]
    context_features: PositiveInt = Field(description="per-request context width")
    bottom_mlp: LayerSizes = Field(description="candidate dense MLP layer sizes")
    context_mlp: LayerSizes = Field(description="context MLP layer sizes, run once per request")
    top_mlp: LayerSizes = Field(description="top MLP layer sizes, ending in 1 (the logit)")

    @model_validator(mode="after")
    def _one_logit(self) -> "ContextRankerSpec":
        if self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp: last layer must be 1 (one logit), got {self.top_mlp[-1]}")
        return self


class PooledEmbeddings(nn.Module):
    """KJT with N rows -> the pooled embeddings of every feature side by side, [N, sum of dims]."""

    def __init__(self, embedding_bag_collection: nn.Module) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.embedding_bag_collection(features).values()


class ContextRanker(nn.Module):
    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        *,
        embedding_width: int,
        dense_in: int,
        bottom_mlp: Sequence[int],
        context_in: int,
        context_mlp: Sequence[int],
        top_mlp: Sequence[int],
        device: torch.device,
    ) -> None:
        super().__init__()
        self.sparse_arch = PooledEmbeddings(embedding_bag_collection)
        self.dense_arch = MLP(dense_in, list(bottom_mlp), device=device)
        self.context_arch = MLP(context_in, list(context_mlp), device=device)
        joined = bottom_mlp[-1] + embedding_width + context_mlp[-1]
        hidden = list(top_mlp[:-1])
        self.over_arch = nn.Sequential(
            *([MLP(joined, hidden, device=device)] if hidden else []),
            nn.Linear(hidden[-1] if hidden else joined, top_mlp[-1], device=device),
        )

    def forward(
        self,
        dense_features: torch.Tensor,
        sparse_features: KeyedJaggedTensor,
        context_features: torch.Tensor,
        item_counts: torch.Tensor,
    ) -> torch.Tensor:
        embeddings = self.sparse_arch(sparse_features)
        return _rank(self, dense_features, embeddings, context_features, item_counts)


class ContextRankerDense(nn.Module):
    """The context ranker after its lookups: ``forward(dense_features [N, D], sparse_embeddings
    [N, E], context_features [K, C], item_counts [K]) -> logits [N, 1]``."""

    def __init__(self, ranker: ContextRanker) -> None:
        super().__init__()
        self.dense_arch = ranker.dense_arch
        self.context_arch = ranker.context_arch
        self.over_arch = ranker.over_arch

    def forward(
        self,
        dense_features: torch.Tensor,
        sparse_embeddings: torch.Tensor,
        context_features: torch.Tensor,
        item_counts: torch.Tensor,
    ) -> torch.Tensor:
        return _rank(self, dense_features, sparse_embeddings, context_features, item_counts)


def _rank(
    arches: ContextRanker | ContextRankerDense,
    dense_features: torch.Tensor,
    sparse_embeddings: torch.Tensor,
    context_features: torch.Tensor,
    item_counts: torch.Tensor,
) -> torch.Tensor:
    context = arches.context_arch(context_features)  # once per request: [K, c]
    context = torch.repeat_interleave(
        context, item_counts, dim=0, output_size=dense_features.shape[0]
    )
    joined = torch.cat([arches.dense_arch(dense_features), sparse_embeddings, context], dim=1)
    return arches.over_arch(joined)


class ContextRankerArchitecture(Architecture):
    name = "context_ranker"
    spec_type = ContextRankerSpec

    def input_tags(self, spec: ContextRankerSpec) -> tuple[InputTag, ...]:
        return per_item_tags(spec) + (
            InputTag(CONTEXT_INPUT, BatchKind.CONTEXT),  # [K, C]: the model broadcasts it
            InputTag(ITEM_COUNTS_INPUT, BatchKind.ITEM_COUNTS),
        )

    def context_features(self, spec: ContextRankerSpec) -> int:
        return spec.context_features

    def build(self, spec: ContextRankerSpec, tables: EmbeddingTables, device: torch.device) -> nn.Module:
        return ContextRanker(
            tables.bags(),
            embedding_width=sum(t.dim * len(t.features) for t in spec.tables),
            dense_in=spec.dense_features,
            bottom_mlp=spec.bottom_mlp,
            context_in=spec.context_features,
            context_mlp=spec.context_mlp,
            top_mlp=spec.top_mlp,
            device=device,
        )

    def split(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        return model.sparse_arch, ContextRankerDense(model)  # type: ignore[arg-type]


ARCHITECTURE = ContextRankerArchitecture()
