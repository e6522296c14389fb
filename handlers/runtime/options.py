"""The ``handler`` section of an archive's ``model-config.yaml``: what the worker loads and how.

    handler:
      artifact: split          # aoti | exported | eager | split | lookups | remote
      sparse: eager            # split only: the parts (handlers.runtime.split.SplitPlan)
      dense: aoti
      dense_device: cpu
      # remote only (a dense host): dense, shards, deadline (handlers.runtime.remote.plan.RemotePlan)
      intra_op_threads: 2      # threads for a large forward
      parallel_from_items: 512 # a forward of fewer items runs on one thread
      metrics_flush_s: 1.0     # how often the worker publishes its counters (0: every batch)

Written by the archive tool, parsed once by the handler (and by the benchmark's in-process
ceiling), so that both load exactly the same thing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InputError
from handlers.runtime.remote.plan import RemotePlan
from handlers.runtime.split import SplitPlan


@dataclasses.dataclass(frozen=True)
class HandlerOptions:
    artifact: Artifact = Artifact.EAGER
    split: SplitPlan | None = None  # the parts of a ``split`` artifact
    intra_op_threads: int = 1
    parallel_from_items: int = 0  # 0: every forward on intra_op_threads threads
    metrics_flush_s: float = 1.0
    remote: RemotePlan | None = None  # a dense host's dense part and shards

    def __post_init__(self) -> None:
        if (self.split is not None) != (self.artifact == Artifact.SPLIT):
            raise InputError("split: a split plan goes with artifact 'split', and only with it")
        if (self.remote is not None) != (self.artifact == Artifact.REMOTE):
            raise InputError("shards: a remote plan goes with artifact 'remote', and only with it")
        if self.intra_op_threads < 1:
            raise InputError(f"intra_op_threads: must be at least 1, got {self.intra_op_threads}")
        if self.parallel_from_items < 0:
            raise InputError(f"parallel_from_items: must be >= 0, got {self.parallel_from_items}")
        if self.metrics_flush_s < 0:
            raise InputError(f"metrics_flush_s: must be >= 0, got {self.metrics_flush_s}")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> "HandlerOptions":
        """From the parsed YAML section (absent: the defaults); a bad value names its key."""
        raw = raw or {}
        defaults = cls()
        value = raw.get("artifact", Artifact.EAGER.value)
        try:
            artifact = Artifact(value)
        except ValueError:
            raise InputError(f"artifact: unknown artifact {value!r}") from None
        split = SplitPlan.from_options(raw) if artifact == Artifact.SPLIT else None
        remote = RemotePlan.from_options(raw) if artifact == Artifact.REMOTE else None
        return cls(
            artifact,
            split,
            _number(raw, "intra_op_threads", defaults.intra_op_threads, int),
            _number(raw, "parallel_from_items", defaults.parallel_from_items, int),
            float(_number(raw, "metrics_flush_s", defaults.metrics_flush_s, (int, float))),
            remote,
        )

    def to_mapping(self) -> dict[str, Any]:
        return {
            "artifact": self.artifact.value,
            **(self.split.to_options() if self.split else {}),
            **(self.remote.to_options() if self.remote else {}),
            "intra_op_threads": self.intra_op_threads,
            "parallel_from_items": self.parallel_from_items,
            "metrics_flush_s": self.metrics_flush_s,
        }

    def threads_for(self, items: int) -> int:
        """Intra-op threads for a forward of ``items`` items."""
        return self.intra_op_threads if items >= self.parallel_from_items else 1

    def describe(self) -> str:
        """What runs, for the worker's log, e.g. ``aoti (model_aoti.pt2)``."""
        if self.split:
            plan = self.split
            parts = f"sparse {plan.sparse_file}, dense {plan.dense_file} on {plan.dense_device}"
            return f"split ({parts})"
        if self.remote:
            return self.remote.describe()
        return f"{self.artifact.value} ({self.artifact.file_name()})"


def _number(raw: Mapping[str, Any], key: str, default: Any, kinds: Any) -> Any:
    value = raw.get(key, default)
    if not isinstance(value, kinds) or isinstance(value, bool):
        raise InputError(f"{key}: must be a number, got {value!r}")
    return value
