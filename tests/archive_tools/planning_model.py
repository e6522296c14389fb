"""A small DLRM trained on clicks with a known structure, for the planner's tests.

Two tables carry the signal (each id adds its own effect to the click's logit), two are noise
(ids drawn independently of the click); every feature's ids follow a Zipf law, as real ids do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import torch

from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import parse_spec
from handlers.modeling.spec import ModelSpec
from torchrec import KeyedJaggedTensor

SIGNAL = ("t_ad", "t_user")
NOISE = ("t_noise_a", "t_noise_b")
_ROWS = {"t_ad": 400, "t_user": 300, "t_noise_a": 400, "t_noise_b": 200}


def planning_spec() -> ModelSpec:
    return parse_spec({
        "name": "planned",
        "dense_features": 2,
        "bottom_mlp": [32, 16],
        "top_mlp": [16, 1],
        "tables": [
            {"name": name, "rows": rows, "dim": 16, "features": [name[2:]], "weight_dtype": "int8"}
            for name, rows in _ROWS.items()
        ],
        "limits": {"max_items_per_request": 256, "max_items_per_forward": 8192},
    })


class Clicks:
    """Items and labels drawn from the known structure: ``dense`` [n, 2], ``ids`` per feature [n]."""

    def __init__(self, count: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        effects = np.random.default_rng(1234)  # the same world for every draw
        self.ids = {name[2:]: _zipf(rng, rows, count) for name, rows in _ROWS.items()}
        self.dense = rng.normal(size=(count, 2)).astype(np.float32)
        logit = 0.5 * self.dense[:, 0] - 1.0
        for name in SIGNAL:
            logit = logit + effects.normal(scale=1.5, size=_ROWS[name])[self.ids[name[2:]]]
        self.labels = (rng.random(count) < 1 / (1 + np.exp(-logit))).astype(np.int64)

    def batch(self, rows: slice) -> tuple[torch.Tensor, KeyedJaggedTensor]:
        features = list(self.ids)
        values = np.concatenate([self.ids[f][rows] for f in features])
        count = len(self.labels[rows])
        return torch.from_numpy(self.dense[rows]), KeyedJaggedTensor.from_lengths_sync(
            keys=features, values=torch.from_numpy(values), lengths=torch.ones(len(features) * count, dtype=torch.int64)
        )

    def write_jsonl(self, path: Path, items_per_request: int = 64) -> Path:
        """One request per line with its labels: the planner's ``--data`` format."""
        lines = []
        for start in range(0, len(self.labels), items_per_request):
            rows = range(start, min(start + items_per_request, len(self.labels)))
            items = [
                {"dense": self.dense[r].tolist(), "sparse": {f: [int(ids[r])] for f, ids in self.ids.items()}}
                for r in rows
            ]
            lines.append(orjson.dumps({"request": {"items": items}, "labels": [int(self.labels[r]) for r in rows]}))
        path.write_bytes(b"\n".join(lines) + b"\n")
        return path


def train(spec: ModelSpec, clicks: Clicks, epochs: int = 4, batch: int = 256, seed: int = 0) -> torch.nn.Module:
    """The float DLRM after ``epochs`` passes over ``clicks``: SGD with a little weight decay on the
    tables (a noise table's rows, pulled every way, stay small), Adam on the dense layers."""
    model = DLRMFactory(spec).float_model(seed=seed).train()
    tables = [p for name, p in model.named_parameters() if ".embedding_bags." in name]
    dense = [p for name, p in model.named_parameters() if ".embedding_bags." not in name]
    optimizers = [torch.optim.SGD(tables, lr=5.0, weight_decay=1e-4), torch.optim.Adam(dense, lr=0.01)]
    labels = torch.from_numpy(clicks.labels).float()
    for _ in range(epochs):
        for start in range(0, len(labels), batch):
            rows = slice(start, start + batch)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(*clicks.batch(rows)).reshape(-1), labels[rows])
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
    return model.eval()


def _zipf(rng: np.random.Generator, rows: int, count: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, rows + 1) ** 1.05
    return rng.choice(rows, size=count, p=weights / weights.sum()).astype(np.int64)
