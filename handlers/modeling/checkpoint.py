"""Trained checkpoints: read a saved state dict, map its names into the model's, load it strictly.

Training wrappers prefix every name: TorchRec's ``DLRMTrain`` with ``model.``, DDP and
``DataParallel`` with ``module.``, ``torch.compile`` with ``_orig_mod.``. Without a
``checkpoint_mapping`` in the spec, a checkpoint whose every name carries one of these prefixes,
and matches the model once it is stripped, is loaded with it stripped (and says so). A ZCH
table's training-only state (its eviction metadata) is left out.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from handlers.modeling.errors import CheckpointError
from handlers.modeling.spec import CheckpointMapping
from handlers.modeling.tbe import ZCH_TRAINING_STATE

WRAPPER_PREFIXES = {
    "model.": "TorchRec's DLRMTrain",
    "module.": "DistributedDataParallel / DataParallel",
    "_orig_mod.": "torch.compile",
}


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """A saved state dict, plain or wrapped as ``{"state_dict": ...}`` / ``{"model": ...}``."""
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:  # not a torch file, or not plain tensors
        raise CheckpointError(f"{path}: not a checkpoint torch can load: {str(e).splitlines()[0]}") from None
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, dict) and set(obj) == {wrapper}:
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a state dict of tensors")
    return obj


def load_checkpoint(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    mapping: CheckpointMapping,
    skip: tuple[str, ...] | None = None,
) -> str | None:
    """Loads a trained state dict strictly, after the spec's name mapping (or a training
    wrapper's prefix, detected where the spec maps nothing). Returns what was stripped, if a
    wrapper was detected. ``skip``: prefixes of the model's names (its tables) neither loaded nor
    expected, so that a checkpoint of the other weights alone loads too.

    Raises ``CheckpointError`` listing every missing, unexpected and mis-shaped key at once.
    """
    expected = {k: v for k, v in model.state_dict().items() if skip is None or not k.startswith(skip)}
    # a ZCH training's eviction metadata: not served (the model's ZCH modules are inference ones)
    state_dict = {k: v for k, v in state_dict.items() if k.rsplit(".", 1)[-1] not in ZCH_TRAINING_STATE}
    detected = None if mapping.prefixes else _wrapper_prefix(state_dict, set(expected), skip)
    if detected is not None:
        mapping = CheckpointMapping(prefixes={detected: ""})
    mapped = {mapping.apply(k): v for k, v in state_dict.items()}
    if skip is not None:
        mapped = {k: v for k, v in mapped.items() if not k.startswith(skip)}
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
            "checkpoint does not match the spec (after checkpoint_mapping): "
            + "; ".join(problems)
            + ". Map other names with checkpoint_mapping.prefixes in the spec; shapes come from "
            "its tables (rows, dim) and MLP sizes"
        )
    model.load_state_dict(mapped, strict=skip is None)
    if detected is None:
        return None
    return f"stripped the prefix {detected!r} of {WRAPPER_PREFIXES[detected]}'s wrapper"


def _wrapper_prefix(
    state_dict: dict[str, torch.Tensor], expected: set[str], skip: tuple[str, ...] | None
) -> str | None:
    def kept(names: set[str]) -> set[str]:
        return {n for n in names if skip is None or not n.startswith(skip)}

    names = set(state_dict)
    if kept(names) == expected:
        return None
    for prefix in WRAPPER_PREFIXES:
        if all(n.startswith(prefix) for n in names) and kept({n[len(prefix):] for n in names}) == expected:
            return prefix
    return None
