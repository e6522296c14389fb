"""The archives, checkpoints and deltas the publishing tests serve and publish: a tiny model's base
checkpoint and a newer one, archives built from them, and damaged copies of deltas."""

from __future__ import annotations

from pathlib import Path

import torch

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.runtime.artifacts import Artifact
from tests.conftest import TINY_SPEC

SPEC = load_spec(TINY_SPEC)


def checkpoints(folder: Path) -> tuple[Path, Path]:
    """A base checkpoint and a newer one whose tables moved in 40% of their rows."""
    model = DLRMFactory(SPEC).float_model(seed=0)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    newer = {k: v.clone() for k, v in base.items()}
    generator = torch.Generator().manual_seed(1)
    for key, value in newer.items():
        if ".embedding_bags." in key:
            touched = torch.rand(value.shape[0], generator=generator) < 0.4
            value[touched] += 0.05 * torch.randn(value[touched].shape, generator=generator)
    torch.save(base, folder / "base.pt")
    torch.save(newer, folder / "newer.pt")
    return folder / "base.pt", folder / "newer.pt"


def build(checkpoint: Path, store: Path, name: str, artifact: Artifact) -> Path:
    return build_archive(
        TINY_SPEC, checkpoint=checkpoint, seed=0, name=name, version="1.0", model_store=store,
        serving=ServingConfig(batch_size=8, max_batch_delay_ms=5), artifact=artifact,
    )


def newer_dense(checkpoint: Path) -> Path:
    """``checkpoint`` with its dense layers trained further too."""
    state = torch.load(checkpoint, weights_only=True)
    generator = torch.Generator().manual_seed(2)
    for key, value in state.items():
        if ".embedding_bags." not in key and value.is_floating_point():
            value += 0.1 * torch.randn(value.shape, generator=generator)
    torch.save(state, checkpoint.with_name("newest.pt"))
    return checkpoint.with_name("newest.pt")


def damaged(setup, name: str, damage, source: str = "eager-2.delta") -> str:
    """A damaged copy of ``source`` (by default the log's next delta)."""
    data = bytearray((setup["deltas"] / source).read_bytes())
    (setup["deltas"] / name).write_bytes(bytes(damage(data)))
    return name


def flip_first_row_byte(data: bytearray) -> bytearray:
    data[12] ^= 0xFF  # inside the first record's row
    return data


def build_paced(checkpoint: Path, store: Path, name: str) -> Path:
    return build_archive(
        TINY_SPEC, checkpoint=checkpoint, seed=0, name=name, version="1.0", model_store=store,
        serving=ServingConfig(batch_size=8, max_batch_delay_ms=5, delta_rows_per_s=200),
    )
