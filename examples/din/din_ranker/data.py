"""Synthetic users for the DIN example: a history of items drawn by popularity (oldest first),
and candidates of which half come from the history; a user clicks 90% of the candidates it
engaged with before and 5% of the others. Each item's category is ``item % 200``.

    python -m din_ranker.data --history 200 --candidates 100 > request.json   # one scoring request
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import numpy as np
import torch

from torchrec import KeyedJaggedTensor  # isort: skip

ITEMS, CATEGORIES, DENSE = 20_000, 200, 4
ZIPF = 1.3  # item popularity's exponent


def category_of(items: np.ndarray) -> np.ndarray:
    return items % CATEGORIES


@dataclass
class Batch:
    """K requests of n candidates each, as the model's forward takes them, with click labels."""

    dense: torch.Tensor  # [N, 4]
    sparse: KeyedJaggedTensor  # candidate, category: N rows
    history: KeyedJaggedTensor  # history: K rows
    item_counts: torch.Tensor  # [K]
    labels: torch.Tensor  # [N]


def _popular(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` items by popularity: Zipf-distributed ranks, scattered over the table."""
    ranks = (rng.zipf(ZIPF, size=count) - 1) % ITEMS
    return (ranks * 7919) % ITEMS  # 7919 is prime: rank -> item is one to one


def user_request(rng: np.random.Generator, history: int, candidates: int) -> tuple[dict, np.ndarray]:
    """One request (the JSON the server takes) and its candidates' click labels."""
    seen = _popular(rng, history)
    items = _popular(rng, candidates)
    if history:  # half the candidates are items the user engaged with before
        again = rng.random(candidates) < 0.5
        items[again] = rng.choice(seen, size=int(again.sum()))
    labels = (rng.random(candidates) < np.where(np.isin(items, seen), 0.9, 0.05)).astype(np.float32)
    request = {
        "items": [
            {"dense": rng.normal(size=DENSE).round(4).tolist(),
             "sparse": {"candidate": [int(i)], "category": [int(category_of(i))]}}
            for i in items
        ],
        "context_sparse": {"history": seen.tolist()},
    }
    return request, labels


def to_batch(requests: list[dict], labels: list[np.ndarray]) -> Batch:
    """JSON requests -> the float model's inputs, with TorchRec's own KeyedJaggedTensor."""
    items = [item for r in requests for item in r["items"]]
    candidates = [item["sparse"]["candidate"] for item in items]
    categories = [item["sparse"]["category"] for item in items]
    histories = [r.get("context_sparse", {}).get("history", []) for r in requests]
    return Batch(
        dense=torch.tensor([item["dense"] for item in items], dtype=torch.float32),
        sparse=KeyedJaggedTensor.from_lengths_sync(
            keys=["candidate", "category"],
            values=torch.tensor([i for bag in candidates + categories for i in bag], dtype=torch.int64),
            lengths=torch.tensor([len(b) for b in candidates + categories], dtype=torch.int64),
        ),
        history=KeyedJaggedTensor.from_lengths_sync(
            keys=["history"],
            values=torch.tensor([i for h in histories for i in h], dtype=torch.int64),
            lengths=torch.tensor([len(h) for h in histories], dtype=torch.int64),
        ),
        item_counts=torch.tensor([len(r["items"]) for r in requests], dtype=torch.int64),
        labels=torch.from_numpy(np.concatenate(labels)) if labels else torch.empty(0),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="print one synthetic scoring request (JSON)")
    parser.add_argument("--history", type=int, default=200, help="items in the user's history")
    parser.add_argument("--candidates", type=int, default=100, help="candidates to score")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    request, _ = user_request(np.random.default_rng(args.seed), args.history, args.candidates)
    json.dump(request, sys.stdout)


if __name__ == "__main__":
    main()
