"""``dlrm``: TorchRec's DLRM, ``forward(dense_features [N, D], sparse_features KJT) -> [N, 1]``.

Bottom MLP on the dense features, pairwise dot products between its output and every feature's
pooled embedding, top MLP to one logit. Spec keys: ``bottom_mlp``, ``top_mlp`` (ending in 1); every
table's ``dim`` equals ``bottom_mlp[-1]``, so that dot products are defined.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from handlers.modeling.architecture import Architecture, per_item_tags
from handlers.modeling.embedding_modules import EmbeddingTables
from handlers.modeling.spec import LayerSizes, ModelSpec
from handlers.runtime.inputs import InputTag

from torchrec.models.dlrm import DLRM  # isort: skip


class DLRMSpec(ModelSpec):
    DENSE_SUBMODULES: ClassVar[tuple[str, ...]] = ("dense_arch", "over_arch")

    architecture: Literal["dlrm"] = "dlrm"
    bottom_mlp: LayerSizes = Field(description="dense (bottom) MLP layer sizes")
    top_mlp: LayerSizes = Field(description="top MLP layer sizes, ending in 1 (the logit)")

    @model_validator(mode="after")
    def _dot_products_defined(self) -> "DLRMSpec":
        if self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp: last layer must be 1 (one logit), got {self.top_mlp[-1]}")
        for i, t in enumerate(self.tables):
            if t.dim != self.bottom_mlp[-1]:
                raise ValueError(
                    f"tables[{i}].dim: must equal bottom_mlp[-1] ({self.bottom_mlp[-1]}) so the "
                    f"interaction can take dot products, got {t.dim}"
                )
        return self


class DLRMDense(nn.Module):
    """A DLRM after its lookups: ``forward(dense_features [N, D], sparse_embeddings [N, F, D'])
    -> logits [N, 1]`` (bottom MLP, interaction, top MLP). Serves DLRM_DCN too: only its
    interaction differs."""

    def __init__(self, dlrm: DLRM) -> None:
        super().__init__()
        self.dense_arch = dlrm.dense_arch
        self.inter_arch = dlrm.inter_arch
        self.over_arch = dlrm.over_arch

    def forward(self, dense_features: torch.Tensor, sparse_embeddings: torch.Tensor) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        joined = self.inter_arch(dense_features=embedded_dense, sparse_features=sparse_embeddings)
        return self.over_arch(joined)


class DLRMArchitecture(Architecture):
    name = "dlrm"
    spec_type = DLRMSpec

    def input_tags(self, spec: DLRMSpec) -> tuple[InputTag, ...]:
        return per_item_tags(spec)

    def build(self, spec: DLRMSpec, tables: EmbeddingTables, device: torch.device) -> nn.Module:
        return DLRM(
            embedding_bag_collection=tables.bags(),
            dense_in_features=spec.dense_features,
            dense_arch_layer_sizes=list(spec.bottom_mlp),
            over_arch_layer_sizes=list(spec.top_mlp),
            dense_device=device,
        )

    def split(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        return model.sparse_arch, DLRMDense(model)  # type: ignore[arg-type]


ARCHITECTURE = DLRMArchitecture()
