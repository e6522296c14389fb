"""The ``handler`` section of an archive's ``model-config.yaml``: what the worker loads and how.

    handler:
      artifact: split          # aoti | exported | eager | split
      sparse: eager            # split only: the parts (handlers.runtime.split.SplitPlan)
      dense: aoti
      dense_device: cpu
      intra_op_threads: 1

Written by the archive tool, parsed once by the handler (and by the benchmark's in-process
ceiling), so that both load exactly the same thing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from handlers.runtime.artifacts import Artifact
from handlers.runtime.split import SplitPlan


@dataclasses.dataclass(frozen=True)
class HandlerOptions:
    artifact: Artifact = Artifact.EAGER
    split: SplitPlan | None = None  # the parts of a ``split`` artifact
    intra_op_threads: int = 1

    def __post_init__(self) -> None:
        if (self.split is not None) != (self.artifact == Artifact.SPLIT):
            raise ValueError("split: a split plan goes with artifact 'split', and only with it")
        if self.intra_op_threads < 1:
            raise ValueError(f"intra_op_threads: must be at least 1, got {self.intra_op_threads}")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> "HandlerOptions":
        """From the parsed YAML section (absent: the defaults); a bad value names its key."""
        raw = raw or {}
        value = raw.get("artifact", Artifact.EAGER.value)
        try:
            artifact = Artifact(value)
        except ValueError:
            raise ValueError(f"artifact: unknown artifact {value!r}") from None
        threads = raw.get("intra_op_threads", 1)
        if not isinstance(threads, int) or isinstance(threads, bool):
            raise ValueError(f"intra_op_threads: must be an integer, got {threads!r}")
        split = SplitPlan.from_options(raw) if artifact == Artifact.SPLIT else None
        return cls(artifact, split, threads)

    def to_mapping(self) -> dict[str, Any]:
        return {
            "artifact": self.artifact.value,
            **(self.split.to_options() if self.split else {}),
            "intra_op_threads": self.intra_op_threads,
        }

    def describe(self) -> str:
        """What runs, for the worker's log, e.g. ``aoti (model_aoti.pt2)``."""
        if self.split:
            plan = self.split
            parts = f"sparse {plan.sparse_file}, dense {plan.dense_file} on {plan.dense_device}"
            return f"split ({parts})"
        return f"{self.artifact.value} ({self.artifact.file_name()})"
