"""A user's architecture, as a test writes it into a folder of its own (not an installed package):
two towers whose embedding collections sit at paths of the user's choosing."""

USER_MODULE = '''
import torch
from torch import nn

from handlers.modeling.architecture import Architecture, per_item_tags
from handlers.modeling.spec import LayerSizes, ModelSpec

from torchrec.modules.mlp import MLP


class TwoTowerSpec(ModelSpec):
    tower: LayerSizes


class TwoTower(nn.Module):
    def __init__(self, spec, tables, device):
        super().__init__()
        self.user_side = nn.ModuleDict({"embeddings": tables.bags("t_user")})
        self.item_bags = tables.bags("t_item", "t_cat")
        width = sum(t.dim for t in spec.tables) + spec.dense_features
        self.tower = nn.Sequential(MLP(width, list(spec.tower), device=device), nn.Linear(spec.tower[-1], 1, device=device))

    def forward(self, dense_features, sparse_features):
        user, item = sparse_features.split([1, 2])
        joined = [self.user_side["embeddings"](user).values(), self.item_bags(item).values(), dense_features]
        return self.tower(torch.cat(joined, dim=1))


class TwoTowerArchitecture(Architecture):
    name = "two_tower"
    spec_type = TwoTowerSpec

    def input_tags(self, spec):
        return per_item_tags(spec)

    def build(self, spec, tables, device):
        return TwoTower(spec, tables, device)
'''

USER_SPEC = {
    "name": "two_tower",
    "dense_features": 3,
    "tower": [16, 8],
    "tables": [
        {"name": "t_user", "rows": 300, "dim": 8, "features": ["user"], "weight_dtype": "int8"},
        {"name": "t_item", "rows": 500, "dim": 8, "features": ["item"], "weight_dtype": "fp16"},
        {"name": "t_cat", "rows": 40, "dim": 4, "features": ["cat"], "weight_dtype": "int4"},
    ],
}
