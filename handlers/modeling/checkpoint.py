"""Trained checkpoints: read a saved state dict, map its names into the model's, load it strictly.

Training wrappers prefix every name: TorchRec's ``DLRMTrain`` with ``model.``, DDP and
``DataParallel`` with ``module.``, ``torch.compile`` with ``_orig_mod.``. Without a
``checkpoint_mapping`` in the spec, a checkpoint whose every name carries one of these prefixes,
and matches the model once it is stripped, is loaded with it stripped (and says so). A raw-id
collection saved as TorchRec's own ``ManagedCollisionEmbeddingBagCollection`` loads as one saved
as its ``McEmbeddingBagCollectionAdapter`` (the float model's names) does. A ZCH table's
training-only state (its eviction metadata) is left out.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from handlers.modeling.checkpoint_names import mismatch
from handlers.modeling.errors import CheckpointError
from handlers.modeling.raw_ids import torchrec_naming
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
    wrapper's prefix, detected where the spec maps nothing). Returns what it read otherwise than
    named, if anything: a wrapper's prefix stripped, TorchRec's own managed-collision names read.
    ``skip``: prefixes of the model's names (its tables) neither loaded nor expected, so that a
    checkpoint of the other weights alone loads too.

    Raises ``CheckpointError`` with the missing, unexpected and mis-shaped names, counted, and the
    mapping or setting that would match them (``checkpoint_names``).
    """
    expected = {k: v for k, v in model.state_dict().items() if skip is None or not k.startswith(skip)}
    # a ZCH training's eviction metadata: not served (the model's ZCH modules are inference ones)
    state_dict = {k: v for k, v in state_dict.items() if k.rsplit(".", 1)[-1] not in ZCH_TRAINING_STATE}
    # a raw-id collection saved as TorchRec's own ManagedCollisionEmbeddingBagCollection, not its adapter
    own = CheckpointMapping(prefixes=torchrec_naming(model))

    def model_name(name: str, spec_mapping: CheckpointMapping) -> str:
        return own.apply(spec_mapping.apply(name))

    def names_under(spec_mapping: CheckpointMapping) -> set[str]:
        names = {model_name(k, spec_mapping) for k in state_dict}
        return {n for n in names if skip is None or not n.startswith(skip)}

    detected = None if mapping.prefixes else _wrapper_prefix(set(state_dict), set(expected), names_under)
    if detected is not None:
        mapping = CheckpointMapping(prefixes={detected: ""})
    mapped = {model_name(k, mapping): v for k, v in state_dict.items()}
    if skip is not None:
        mapped = {k: v for k, v in mapped.items() if not k.startswith(skip)}
    misshaped = sorted(
        f"{k}: checkpoint {tuple(mapped[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(mapped) & set(expected)
        if mapped[k].shape != expected[k].shape
    )
    if set(mapped) != set(expected) or misshaped:
        raise CheckpointError(mismatch(names_under, mapping, set(expected), misshaped))
    model.load_state_dict(mapped, strict=skip is None)
    notes = [f"stripped the prefix {detected!r} of {WRAPPER_PREFIXES[detected]}'s wrapper"] if detected else []
    renamed = sorted({old for k in state_dict for old in own.prefixes if mapping.apply(k).startswith(old)})
    if renamed:
        at = sorted({old.rsplit(".", 2)[0] for old in renamed})
        notes.append(f"read TorchRec's ManagedCollisionEmbeddingBagCollection names at {', '.join(at)} "
                     "as its McEmbeddingBagCollectionAdapter's")
    return "; ".join(notes) or None


def _wrapper_prefix(
    names: set[str], expected: set[str], names_under: Callable[[CheckpointMapping], set[str]]
) -> str | None:
    if names_under(CheckpointMapping()) == expected:
        return None
    for prefix in WRAPPER_PREFIXES:
        stripped = CheckpointMapping(prefixes={prefix: ""})
        if all(n.startswith(prefix) for n in names) and names_under(stripped) == expected:
            return prefix
    return None
