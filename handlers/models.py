"""The model architectures a spec can name, and each one's inputs with their batch tags.

The tags are declared here, next to the forward signatures they describe; the coalescer
(``handlers.batching``) and the service read them and know nothing else about the model.

* ``dlrm``: TorchRec's ``DLRM.forward(dense_features [N, D], sparse_features KJT) -> [N, 1]``.
* ``context_ranker``: ``ContextRanker`` below; request-level context computed once per request.

Both split into a sparse part (the embedding lookups) and a dense part (everything after them);
``split_model`` returns the two, sharing the model's modules, so that each can be captured as a
graph of its own and placed on its own device (``handlers.split``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from handlers.batching import BatchKind, InputTag
from handlers.spec import Architecture, ModelSpec

from torchrec import EmbeddingBagCollection, KeyedJaggedTensor  # isort: skip
from torchrec.models.dlrm import DLRM  # isort: skip
from torchrec.modules.mlp import MLP  # isort: skip

DENSE_INPUT = "dense_features"
SPARSE_INPUT = "sparse_features"
CONTEXT_INPUT = "context_features"
ITEM_COUNTS_INPUT = "item_counts"
# The sparse part's output, a dense part's input: [N, F, D] for DLRM, [N, sum of dims] otherwise.
EMBEDDINGS_INPUT = "sparse_embeddings"

# Where the embedding tables live in every architecture (the factory swaps and shards them there).
EBC_PATH = "sparse_arch.embedding_bag_collection"


def input_tags(spec: ModelSpec) -> tuple[InputTag, ...]:
    """The model's forward inputs, by name, and how each batches."""
    per_item = (
        InputTag(DENSE_INPUT, BatchKind.ROWS),
        InputTag(SPARSE_INPUT, BatchKind.JAGGED, keys=spec.feature_names),
    )
    if spec.architecture == Architecture.DLRM:
        return per_item
    return per_item + (
        InputTag(CONTEXT_INPUT, BatchKind.CONTEXT),  # [K, C]: the model broadcasts it
        InputTag(ITEM_COUNTS_INPUT, BatchKind.ITEM_COUNTS),
    )


def sparse_tags(spec: ModelSpec) -> tuple[InputTag, ...]:
    """The sparse part's inputs: the bags of ids."""
    return tuple(t for t in input_tags(spec) if t.kind == BatchKind.JAGGED)


def dense_tags(spec: ModelSpec) -> tuple[InputTag, ...]:
    """The dense part's inputs: the model's, with the pooled embeddings in place of the ids."""
    return tuple(
        InputTag(EMBEDDINGS_INPUT, BatchKind.ROWS) if t.kind == BatchKind.JAGGED else t
        for t in input_tags(spec)
    )


def split_model(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``model`` as (sparse part, dense part), sharing its modules (and weights):
    ``model(**inputs) == dense(**others, sparse_embeddings=sparse(sparse_features))``."""
    if isinstance(model, DLRM):
        return model.sparse_arch, DLRMDense(model)
    if isinstance(model, ContextRanker):
        return model.sparse_arch, ContextRankerDense(model)
    raise TypeError(f"cannot split a {type(model).__name__}")


def build_model(spec: ModelSpec, ebc: nn.Module, device: str) -> nn.Module:
    """The spec's architecture around ``ebc`` (float, meta or quantized), dense layers on ``device``."""
    dense_device = torch.device(device)
    if spec.architecture == Architecture.DLRM:
        return DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=spec.dense_features,
            dense_arch_layer_sizes=list(spec.bottom_mlp),
            over_arch_layer_sizes=list(spec.top_mlp),
            dense_device=dense_device,
        )
    return ContextRanker(
        ebc,
        embedding_width=sum(t.dim * len(t.features) for t in spec.tables),
        dense_in=spec.dense_features,
        bottom_mlp=spec.bottom_mlp,
        context_in=spec.context_features,
        context_mlp=spec.context_mlp,
        top_mlp=spec.top_mlp,
        device=dense_device,
    )


class PooledEmbeddings(nn.Module):
    """KJT with N rows -> the pooled embeddings of every feature side by side, [N, sum of dims]."""

    def __init__(self, embedding_bag_collection: nn.Module) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.embedding_bag_collection(features).values()


class ContextRanker(nn.Module):
    """Scores a request's candidates against its context (e.g. one user, 100 candidate items).

    ``forward(dense_features [N, D], sparse_features KJT of N rows, context_features [K, C],
    item_counts int64 [K]) -> logits [N, 1]`` for K requests of n_1..n_K items (N = sum).

    The context MLP runs once per request ([K, C] -> [K, c]); its output is repeated to the request's
    items and joined with each candidate's dense MLP output and pooled embeddings for the top MLP.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection | nn.Module,
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


class DLRMDense(nn.Module):
    """TorchRec's DLRM after its lookups: ``forward(dense_features [N, D], sparse_embeddings
    [N, F, D']) -> logits [N, 1]`` (bottom MLP, pairwise interaction, top MLP)."""

    def __init__(self, dlrm: DLRM) -> None:
        super().__init__()
        self.dense_arch = dlrm.dense_arch
        self.inter_arch = dlrm.inter_arch
        self.over_arch = dlrm.over_arch

    def forward(self, dense_features: torch.Tensor, sparse_embeddings: torch.Tensor) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        joined = self.inter_arch(dense_features=embedded_dense, sparse_features=sparse_embeddings)
        return self.over_arch(joined)
