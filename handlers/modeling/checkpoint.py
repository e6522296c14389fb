"""Trained checkpoints: read a saved state dict, map its names into the model's, load it strictly."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from handlers.modeling.errors import CheckpointError
from handlers.modeling.spec import CheckpointMapping


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """A saved state dict, plain or wrapped as ``{"state_dict": ...}`` / ``{"model": ...}``."""
    obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, dict) and set(obj) == {wrapper}:
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a state dict of tensors")
    return obj


def load_checkpoint(
    model: nn.Module, state_dict: dict[str, torch.Tensor], mapping: CheckpointMapping
) -> None:
    """Loads a trained state dict strictly, after the spec's name mapping.

    Raises ``CheckpointError`` listing every missing, unexpected and mis-shaped key at once.
    """
    mapped = {mapping.apply(k): v for k, v in state_dict.items()}
    expected = model.state_dict()
    missing = sorted(set(expected) - set(mapped))
    unexpected = sorted(set(mapped) - set(expected))
    misshaped = sorted(
        f"{k}: checkpoint {tuple(mapped[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(mapped) & set(expected)
        if mapped[k].shape != expected[k].shape
    )
    problems = [
        f"{label}: {', '.join(keys)}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
        if keys
    ]
    if problems:
        raise CheckpointError(
            "checkpoint does not match the spec (after checkpoint_mapping): " + "; ".join(problems)
        )
    model.load_state_dict(mapped, strict=True)
