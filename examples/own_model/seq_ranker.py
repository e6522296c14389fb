"""A model written with TorchRec alone, as a team trains it, and the two small classes that serve it.

``SeqRanker`` knows nothing of this project: its own constructors, its own ``forward``. It scores a
request's candidates for one user: each candidate's item row (exactly one id an item, looked up
unpooled), the user's row (exactly one id an item) and the mean of the user's history (sent once
per request, any length, empty for a new user)::

    SeqRanker.forward(candidates KJT [N], users KJT [N], history KJT [K], item_counts [K]) -> logits [N, 1]

``Served`` adapts the project's inputs (``dense_features``, ``sparse_features`` holding the
spec's item features in order, ``history``, ``item_counts``) to that ``forward``; it holds the model
as ``model``, so the checkpoint's names get a ``model.`` prefix (the spec's ``checkpoint_mapping``).
``SeqRankerArchitecture`` is what the spec names: ``architecture: seq_ranker:SeqRankerArchitecture``
with this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import torch
from torch import nn

from handlers.modeling.architecture import DENSE_INPUT, ITEM_COUNTS_INPUT, SPARSE_INPUT, Architecture
from handlers.modeling.spec import ModelSpec
from handlers.runtime.inputs import BatchKind, InputTag

from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig  # isort: skip
from torchrec import KeyedJaggedTensor, PoolingType  # isort: skip


class SeqRanker(nn.Module):
    def __init__(self, items: int = 2_000, users: int = 500, dim: int = 8, device: torch.device | None = None) -> None:
        super().__init__()
        self.candidates = EmbeddingCollection(
            tables=[EmbeddingConfig(name="t_item", embedding_dim=dim, num_embeddings=items, feature_names=["candidate"])],
            device=device,
        )
        self.users = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t_user", embedding_dim=dim, num_embeddings=users, feature_names=["user_id"])],
            device=device,
        )
        self.history = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="t_history", embedding_dim=dim, num_embeddings=items, feature_names=["history"],
                    pooling=PoolingType.MEAN,
                )
            ],
            device=device,
        )
        self.top = nn.Sequential(nn.Linear(3 * dim, 16, device=device), nn.ReLU(), nn.Linear(16, 1, device=device))

    def forward(
        self, candidates: KeyedJaggedTensor, users: KeyedJaggedTensor, history: KeyedJaggedTensor, item_counts: torch.Tensor
    ) -> torch.Tensor:
        candidate = self.candidates(candidates)["candidate"].values()  # [N, d]: one id an item, or cat fails
        user = self.users(users).values()  # [N, d]
        past = self.history(history).values()  # [K, d], zeros for an empty history
        past = torch.repeat_interleave(past, item_counts, dim=0, output_size=user.shape[0])  # [N, d]
        return self.top(torch.cat([candidate, user, past], dim=1))


class Served(nn.Module):
    """The project's inputs -> ``SeqRanker``'s. The dense rows are unused: the contract asks every
    model for one dense input, and this one's requests send a single 0 per item."""

    def __init__(self, model: SeqRanker) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        dense_features: torch.Tensor,
        sparse_features: KeyedJaggedTensor,
        history: KeyedJaggedTensor,
        item_counts: torch.Tensor,
    ) -> torch.Tensor:
        candidates, users = sparse_features.split([1, 1])  # the spec's item features, in order
        return self.model(candidates, users, history, item_counts)


class SeqRankerArchitecture(Architecture):
    name = "seq_ranker"
    spec_type = ModelSpec

    def input_tags(self, spec: ModelSpec) -> tuple[InputTag, ...]:
        return (
            InputTag(DENSE_INPUT, BatchKind.ROWS),
            InputTag(SPARSE_INPUT, BatchKind.JAGGED, keys=("candidate", "user_id")),
            InputTag("history", BatchKind.CONTEXT_JAGGED, keys=("history",)),
            InputTag(ITEM_COUNTS_INPUT, BatchKind.ITEM_COUNTS),
        )

    def build(self, spec: ModelSpec, tables, device: torch.device) -> nn.Module:
        """The model as its team builds it. Its tables come out on ``device`` too, in float, until
        the build quantizes them: fine while they fit in memory (constructors that take
        ``tables.device`` for their collections, as ``EmbeddingTables`` does, never allocate them)."""
        rows = {t.name: t.rows for t in spec.tables}
        return Served(SeqRanker(rows["t_item"], rows["t_user"], spec.tables[0].dim, device=device))
