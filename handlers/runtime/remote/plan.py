"""What a dense host of a distributed layout calls: its embedding shards (which features each
serves, under which model name, how wide its pooled embeddings are) and, apart from the archive,
where their replicas are.

The archive says *what* (the ``handler`` section of the dense archive's ``model-config.yaml``)::

    handler:
      artifact: remote
      dense: aoti                       # the dense part: aoti | exported
      shards:
        - {name: a, model: criteo-a, features: [cat_0, ..., cat_12], widths: [128, ..., 128]}
        - {name: b, model: criteo-b, features: [cat_13, ..., cat_25], widths: [128, ..., 128]}
      stacked: true                     # the dense part takes [N, F, D] (else [N, sum of widths])
      deadline: {floor_ms: 50, max_ms: 500, multiple: 8, retry_after_s: 1}

and a placement file says *where* (deployment, not model: the same archives serve any layout),
named by the environment variable ``TORCHREC_SERVE_PLACEMENT`` of the dense host's TorchServe::

    shards:
      a: ["10.0.0.11:7070", "10.0.0.12:7070"]    # each replica's gRPC inference address
      b: ["10.0.0.13:7070"]
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InputError

PLACEMENT_ENV = "TORCHREC_SERVE_PLACEMENT"
DENSE_ARTIFACTS = (Artifact.AOTI, Artifact.EXPORTED)


@dataclasses.dataclass(frozen=True)
class ShardRoute:
    """One embedding shard: ``features`` it looks up (in model order), the ``model`` name its hosts
    serve it under, the ``widths`` of its features' pooled embeddings, and its ``replicas``' gRPC
    inference addresses (``host:port``; from the placement)."""

    name: str
    model: str
    features: tuple[str, ...]
    widths: tuple[int, ...]
    replicas: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.widths) != len(self.features) or not all(w > 0 for w in self.widths):
            raise InputError(f"shards.{self.name}.widths: one positive width per feature, got {self.widths}")

    def to_options(self) -> dict[str, Any]:
        return {
            "name": self.name, "model": self.model, "features": list(self.features), "widths": list(self.widths),
        }


@dataclasses.dataclass(frozen=True)
class Deadline:
    """How long a shard call may take. An attempt on one replica, while a live one is left to try
    after it, gets ``multiple`` x the shard's recent p99 call time, within [``floor_ms``,
    ``max_ms``] (``max_ms`` until 20 calls are measured); the last live replica gets the rest of
    the shard's deadline: ``max_ms``, or attempts x replicas if longer. Then the shard is given
    up. A replica that failed is tried last for ``retry_after_s``."""

    floor_ms: float = 50.0
    max_ms: float = 500.0
    multiple: float = 8.0
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        for key in ("floor_ms", "max_ms", "multiple", "retry_after_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise InputError(f"deadline.{key}: must be a positive number, got {value!r}")
        if self.floor_ms > self.max_ms:
            raise InputError(f"deadline.floor_ms: must not exceed max_ms ({self.max_ms}), got {self.floor_ms}")


@dataclasses.dataclass(frozen=True)
class RemotePlan:
    """A dense host: its dense part's artifact, its shards, their deadline."""

    dense: Artifact
    shards: tuple[ShardRoute, ...]
    stacked: bool = True  # the dense part takes [N, F, D]; else [N, sum of widths]
    deadline: Deadline = Deadline()

    def __post_init__(self) -> None:
        if self.dense not in DENSE_ARTIFACTS:
            raise InputError(f"dense: must be one of {[a.value for a in DENSE_ARTIFACTS]}, got {self.dense.value!r}")
        if not self.shards:
            raise InputError("shards: a dense host needs at least one shard")

    @property
    def dense_file(self) -> str:
        return self.dense.file_name("dense")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "RemotePlan":
        """From the archive's ``handler`` options; a bad value raises ValueError naming its key."""
        value = options.get("dense", Artifact.AOTI.value)
        try:
            dense = Artifact(value)
        except ValueError:
            raise InputError(f"dense: unknown artifact {value!r}") from None
        raw_shards = options.get("shards")
        if not isinstance(raw_shards, list):
            raise InputError(f"shards: must be a list of shards, got {raw_shards!r}")
        shards = []
        for i, raw in enumerate(raw_shards):
            try:
                shards.append(ShardRoute(
                    name=str(raw["name"]), model=str(raw["model"]),
                    features=tuple(str(f) for f in raw["features"]),
                    widths=tuple(int(w) for w in raw["widths"]),
                ))
            except (KeyError, TypeError, ValueError) as e:
                raise InputError(f"shards[{i}]: needs name, model, features and widths ({e})") from None
        stacked = options.get("stacked", True)
        if not isinstance(stacked, bool):
            raise InputError(f"stacked: must be true or false, got {stacked!r}")
        raw_deadline = options.get("deadline", {})
        if not isinstance(raw_deadline, Mapping):
            raise InputError(f"deadline: must be a mapping, got {raw_deadline!r}")
        unknown = sorted(set(raw_deadline) - {f.name for f in dataclasses.fields(Deadline)})
        if unknown:
            raise InputError(f"deadline.{unknown[0]}: unknown key")
        return cls(dense, tuple(shards), stacked, Deadline(**raw_deadline))

    def to_options(self) -> dict[str, Any]:
        return {
            "dense": self.dense.value,
            "shards": [s.to_options() for s in self.shards],
            "stacked": self.stacked,
            "deadline": dataclasses.asdict(self.deadline),
        }

    def placed(self, placement: Mapping[str, Sequence[str]]) -> "RemotePlan":
        """The plan with each shard's replicas from ``placement`` (shard name -> addresses)."""
        missing = [s.name for s in self.shards if not placement.get(s.name)]
        if missing:
            raise InputError(f"placement: no replica given for shard(s) {missing}")
        shards = tuple(dataclasses.replace(s, replicas=tuple(placement[s.name])) for s in self.shards)
        return dataclasses.replace(self, shards=shards)

    def describe(self) -> str:
        return f"remote (dense {self.dense_file}; shards {', '.join(s.name for s in self.shards)})"


def read_placement(path: str | Path | None = None) -> dict[str, list[str]]:
    """Shard name -> replica addresses, from ``path`` or the file ``TORCHREC_SERVE_PLACEMENT``
    names; raises ValueError saying what is missing or malformed."""
    if path is None:
        path = os.environ.get(PLACEMENT_ENV)
        if not path:
            raise InputError(
                f"{PLACEMENT_ENV}: not set; a dense host needs a placement file saying where its "
                "shards are (torchrec-serve launch writes one)"
            )
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InputError(f"placement {path}: cannot be read: {e}") from None
    shards = raw.get("shards") if isinstance(raw, dict) else None
    if not isinstance(shards, dict):
        raise InputError(f"placement {path}: shards: must map each shard to its replicas' addresses")
    placement = {}
    for name, replicas in shards.items():
        if not isinstance(replicas, list) or not all(isinstance(r, str) and ":" in r for r in replicas):
            raise InputError(f"placement {path}: shards.{name}: must be a list of host:port, got {replicas!r}")
        placement[str(name)] = replicas
    return placement
