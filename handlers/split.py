"""The split model: the embedding lookups and the dense layers as two parts, run one after the
other by a small executor, each part on its own device and in its own artifact kind.

    batch on the spec's device ──> sparse part (ids -> embeddings [N, ...])
                                          │ .to(dense_device)
    dense inputs .to(dense_device) ──> dense part (dense, embeddings, context) -> logits [N, 1]

The parts are ``handlers.models.split_model``'s. An archive stores each one in files of its own
(``sparse.pt2``, ``dense_aoti.pt2`` ..., or for eager lookups the mapped ``weights.pt``, tables
only), so either can be rebuilt, recompiled or moved without the other. ``SplitPlan`` (in the
``handler`` section of the archive's ``model-config.yaml``) says which is which::

    handler: {artifact: split, sparse: exported, dense: aoti, dense_device: cpu}
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from handlers.batching import BatchInput, InputTag
from handlers.export import Artifact, GraphModel
from handlers.factory import DLRMFactory
from handlers.models import EMBEDDINGS_INPUT, dense_tags, sparse_tags
from handlers.spec import ModelSpec

SPARSE_ARTIFACTS = (Artifact.AOTI, Artifact.EXPORTED, Artifact.EAGER)
DENSE_ARTIFACTS = (Artifact.AOTI, Artifact.EXPORTED)
DEVICES = ("cpu", "cuda")

Part = Callable[..., torch.Tensor]  # the part's inputs by name -> its output


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """What each part of a split archive is, and where the dense part runs.

    ``sparse``: aoti | exported | eager (TorchRec modules on the mapped ``weights.pt``);
    ``dense``: aoti | exported; ``dense_device``: cpu | cuda (exported dense part only: the program
    is captured on cpu and moved at load).
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
                raise ValueError(f"{field}: must be one of {allowed}, got {value!r}")
        if self.dense_device != "cpu" and self.dense == Artifact.AOTI:
            raise ValueError(
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
                raise ValueError(f"{key}: unknown artifact {value!r}") from None
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

    def __init__(
        self,
        sparse: Part,
        dense: Part,
        sparse_inputs: Sequence[InputTag],
        dense_inputs: Sequence[InputTag],
        dense_device: str = "cpu",
    ) -> None:
        self.sparse = sparse
        self.dense = dense
        self.sparse_names = [t.name for t in sparse_inputs]
        self.dense_names = [t.name for t in dense_inputs if t.name != EMBEDDINGS_INPUT]
        self.dense_device = torch.device(dense_device)

    @classmethod
    def load(cls, model_dir: str | Path, spec: ModelSpec, plan: SplitPlan) -> "SplitModel":
        """The two parts of a split archive folder, as ``plan`` says."""
        if plan.dense_device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("dense_device: cuda, but this worker sees no CUDA device")
        model_dir = Path(model_dir)
        sparse_inputs, dense_inputs = sparse_tags(spec), dense_tags(spec)
        if plan.sparse == Artifact.EAGER:
            factory = DLRMFactory(spec)
            lookups = factory.lookups(factory.load_weights(model_dir / plan.sparse_file))
            sparse: Part = eager_part(lookups, sparse_inputs)
        else:
            sparse = GraphModel(
                model_dir / plan.sparse_file, plan.sparse, sparse_inputs, spec.sharding.device
            )
        dense = GraphModel(model_dir / plan.dense_file, plan.dense, dense_inputs, plan.dense_device)
        return cls(sparse, dense, sparse_inputs, dense_inputs, plan.dense_device)

    def __call__(self, **batch: BatchInput) -> torch.Tensor:
        embeddings = self.sparse(**{name: batch[name] for name in self.sparse_names})
        # .to() of a tensor already there returns it: no copy when both parts share a device
        dense_inputs = {name: batch[name].to(self.dense_device) for name in self.dense_names}
        return self.dense(**dense_inputs, **{EMBEDDINGS_INPUT: embeddings.to(self.dense_device)})


def eager_part(module: nn.Module, tags: Sequence[InputTag]) -> Part:
    """An eager part (its forward takes the inputs in tag order), called with them by name."""
    names = [t.name for t in tags]
    return lambda **inputs: module(*(inputs[name] for name in names))


def _values(artifacts: Sequence[Artifact]) -> list[str]:
    return [a.value for a in artifacts]
