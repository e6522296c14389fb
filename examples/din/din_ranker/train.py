"""Trains the DIN example on synthetic users (``din_ranker.data``) and saves its state dict: the
checkpoint ``torchrec-serve build --checkpoint`` takes.

    python -m din_ranker.train --steps 300 --out din.pt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from din_ranker.data import to_batch, user_request
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec

SPEC = Path(__file__).with_name("din.yaml")


def train(spec_path: Path, steps: int, out: Path, seed: int = 0, requests_per_step: int = 16) -> float:
    """Trains ``steps`` Adam steps of ``requests_per_step`` users x 20 candidates (histories of
    5 to 100 items); saves the state dict to ``out`` and returns the held-out AUC."""
    spec = load_spec(spec_path)
    model = DLRMFactory(spec).float_model(seed=seed).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(seed)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    progress = tqdm(range(steps), desc="train", unit="step")
    for _ in progress:
        pairs = [user_request(rng, int(rng.integers(5, 101)), 20) for _ in range(requests_per_step)]
        batch = to_batch([p[0] for p in pairs], [p[1] for p in pairs])
        logits = model(batch.dense, batch.sparse, batch.history, batch.item_counts).reshape(-1)
        loss = loss_fn(logits, batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        progress.set_postfix(loss=f"{loss.item():.4f}")
    model.eval()
    pairs = [user_request(np.random.default_rng(10_000 + i), 50, 20) for i in range(64)]
    held_out = to_batch([p[0] for p in pairs], [p[1] for p in pairs])
    with torch.inference_mode():
        scores = model(held_out.dense, held_out.sparse, held_out.history, held_out.item_counts).reshape(-1)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out)
    return _auc(scores.numpy(), held_out.labels.numpy())


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    order = np.argsort(scores)
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    positives = labels.sum()
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * (len(labels) - positives)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="train the DIN example on synthetic users")
    parser.add_argument("--spec", type=Path, default=SPEC)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("din.pt"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    auc = train(args.spec, args.steps, args.out, args.seed)
    print(f"wrote {args.out}; held-out AUC {auc:.3f}")


if __name__ == "__main__":
    main()
