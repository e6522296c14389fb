"""``dlrm_dcn``: DLRMv2, the MLPerf Criteo-1TB model (TorchRec's ``DLRM_DCN``).

``forward(dense_features [N, D], sparse_features KJT) -> [N, 1]``: the bottom MLP's output and every
feature's pooled embedding, concatenated ([N, (F + 1) * dim]), pass through a low-rank deep cross
network (``dcn_num_layers`` layers of rank ``dcn_low_rank_dim``: x_{l+1} = x_0 * (W_l (V_l x_l) +
b_l) + x_l) instead of DLRM's dot products, then the top MLP. Spec keys: those of ``dlrm`` plus
``dcn_num_layers`` and ``dcn_low_rank_dim``; every table's ``dim`` equals ``bottom_mlp[-1]``.
Its lookups and dense part split like DLRM's.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from handlers.modeling.architectures.dlrm import DLRMArchitecture, DLRMSpec
from handlers.modeling.embedding_modules import EmbeddingTables
from handlers.modeling.spec import PositiveInt

from torchrec.models.dlrm import DLRM_DCN  # isort: skip


class DLRMDCNSpec(DLRMSpec):
    # The cross network's weights are plain parameters, not Linear layers: TorchAO's int8 would
    # leave them as they are, so only the MLPs take a dense precision.
    DENSE_SUBMODULES: ClassVar[tuple[str, ...]] = ("dense_arch", "over_arch")

    architecture: Literal["dlrm_dcn"] = "dlrm_dcn"  # type: ignore[assignment]
    dcn_num_layers: PositiveInt = Field(description="cross layers in the interaction")
    dcn_low_rank_dim: PositiveInt = Field(description="rank of each cross layer's weight")


class DLRMDCNArchitecture(DLRMArchitecture):
    name = "dlrm_dcn"
    spec_type = DLRMDCNSpec

    def build(self, spec: DLRMDCNSpec, tables: EmbeddingTables, device: torch.device) -> nn.Module:  # type: ignore[override]
        model = DLRM_DCN(
            embedding_bag_collection=tables.bags(),
            dense_in_features=spec.dense_features,
            dense_arch_layer_sizes=list(spec.bottom_mlp),
            over_arch_layer_sizes=list(spec.top_mlp),
            dcn_num_layers=spec.dcn_num_layers,
            dcn_low_rank_dim=spec.dcn_low_rank_dim,
            dense_device=device,
        )
        model.inter_arch.to(device)  # TorchRec builds the cross network on the default device
        return model


ARCHITECTURE = DLRMDCNArchitecture()
