"""A user's architecture whose model takes exactly one id per feature and raises on any other bag,
as a model written for its training data alone does; named by import path
(``tests.archive_tools.model_raising:OneIdArchitecture``)."""

import torch
from torch import nn

from handlers.modeling.architecture import Architecture, per_item_tags
from handlers.modeling.spec import ModelSpec

SPEC = {
    "name": "one_id",
    "architecture": "tests.archive_tools.model_raising:OneIdArchitecture",
    "dense_features": 3,
    "tables": [
        {"name": "t_user", "rows": 100, "dim": 4, "features": ["user"]},
        {"name": "t_item", "rows": 100, "dim": 4, "features": ["item"]},
    ],
}


class OneIdModel(nn.Module):
    def __init__(self, spec, tables, device):
        super().__init__()
        self.bags = tables.bags()
        self.out = nn.Linear(sum(t.dim for t in spec.tables) + spec.dense_features, 1, device=device)

    def forward(self, dense_features, sparse_features):
        lengths = sparse_features.lengths()
        if not bool((lengths == 1).all()):
            raise IndexError(f"one id per feature, got bags of {int(lengths.min())}-{int(lengths.max())}")
        return self.out(torch.cat([self.bags(sparse_features).values(), dense_features], dim=1))


class OneIdArchitecture(Architecture):
    name = "one_id"
    spec_type = ModelSpec

    def input_tags(self, spec):
        return per_item_tags(spec)

    def build(self, spec, tables, device):
        return OneIdModel(spec, tables, device)
