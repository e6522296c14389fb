"""The split model: the embedding lookups and the dense layers as two parts, run one after the
other by a small executor, each part in its own artifact kind and on its own device.

    batch ──> sparse part (ids -> embeddings [N, ...]) ──┐
    dense inputs ───────────────────────────────────────> dense part (on dense_device) -> logits [N, 1]

An archive stores each part in files of its own (``sparse.pt2``, ``dense_aoti.pt2`` ..., or for
eager lookups the mapped ``weights.pt``, tables only), so either can be rebuilt, recompiled or
moved without the other. ``SplitPlan`` (in the ``handler`` section of the archive's
``model-config.yaml``) says which is which::

    handler: {artifact: split, sparse: exported, dense: aoti, dense_device: cpu}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from handlers.runtime.artifacts import Artifact, Runner
from handlers.runtime.batching import Batch
from handlers.runtime.errors import InputError
from handlers.runtime.inputs import BatchKind, InputTag

SPARSE_ARTIFACTS = (Artifact.AOTI, Artifact.EXPORTED, Artifact.EAGER)
DENSE_ARTIFACTS = (Artifact.AOTI, Artifact.EXPORTED)
DEVICES = ("cpu", "cuda")

# The sparse part's output, the dense part's input: [N, F, D] for DLRM, [N, sum of dims] otherwise.
EMBEDDINGS_INPUT = "sparse_embeddings"


def sparse_tags(tags: Sequence[InputTag]) -> tuple[InputTag, ...]:
    """The sparse part's inputs: the bags of ids."""
    return tuple(t for t in tags if t.kind == BatchKind.JAGGED)


def dense_tags(tags: Sequence[InputTag]) -> tuple[InputTag, ...]:
    """The dense part's inputs: the model's, with the pooled embeddings in place of the ids."""
    return tuple(
        InputTag(EMBEDDINGS_INPUT, BatchKind.ROWS) if t.kind == BatchKind.JAGGED else t for t in tags
    )


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """What each part of a split archive is, and where the dense part runs.

    ``sparse``: aoti | exported | eager (TorchRec modules on the mapped ``weights.pt``);
    ``dense``: aoti | exported; ``dense_device``: cpu | cuda (exported dense part only: the program
    is captured on cpu and moved at load, to the GPU TorchServe gives the worker).
    """

    sparse: Artifact = Artifact.EXPORTED
    dense: Artifact = Artifact.AOTI
    dense_device: str = "cpu"

    def __post_init__(self) -> None:
        for field, value, allowed in (
            ("sparse", self.sparse.value, _values(SPARSE_ARTIFACTS)),
            ("dense", self.dense.value, _values(DENSE_ARTIFACTS)),
            ("dense_device", self.dense_device, list(DEVICES)),
        ):
            if value not in allowed:
                raise InputError(f"{field}: must be one of {allowed}, got {value!r}")
        if self.dense_device != "cpu" and self.dense == Artifact.AOTI:
            raise InputError(
                f"dense_device: {self.dense_device} needs dense: exported (moved there at load); "
                "this tool compiles AOTInductor packages for cpu only"
            )

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "SplitPlan":
        """From the archive's ``handler`` options (``model-config.yaml``) or the build's CLI;
        a bad value raises ValueError naming its key."""
        defaults = cls()
        artifacts = {}
        for key in ("sparse", "dense"):
            value = options.get(key, getattr(defaults, key).value)
            try:
                artifacts[key] = Artifact(value)
            except ValueError:
                raise InputError(f"{key}: unknown artifact {value!r}") from None
        device = str(options.get("dense_device", defaults.dense_device))
        return cls(**artifacts, dense_device=device)

    def to_options(self) -> dict[str, str]:
        return {
            "sparse": self.sparse.value,
            "dense": self.dense.value,
            "dense_device": self.dense_device,
        }

    @property
    def sparse_file(self) -> str:
        return self.sparse.file_name("sparse")

    @property
    def dense_file(self) -> str:
        return self.dense.file_name("dense")

    @property
    def files(self) -> list[str]:
        return self.sparse.files("sparse") + self.dense.files("dense")


class SplitModel:
    """Runs the sparse part, then the dense part; called like the whole model with the batch."""

    def __init__(self, sparse: Runner, dense: Runner, tags: Sequence[InputTag]) -> None:
        self.sparse = sparse
        self.dense = dense
        self.sparse_names = [t.name for t in sparse_tags(tags)]
        self.dense_names = [t.name for t in dense_tags(tags) if t.name != EMBEDDINGS_INPUT]

    def __call__(self, batch: Batch) -> torch.Tensor:
        embeddings = self.sparse({name: batch[name] for name in self.sparse_names})
        dense_inputs: Batch = {name: batch[name] for name in self.dense_names}
        dense_inputs[EMBEDDINGS_INPUT] = embeddings
        return self.dense(dense_inputs)


def _values(artifacts: Sequence[Artifact]) -> list[str]:
    return [a.value for a in artifacts]
