"""How a raw-id table maps 64-bit feature ids to its rows: a table's ``remap`` section.

A table with ``ids: raw`` takes any int64 id (user, item or ad ids, hashes of strings) and
TorchRec's managed collisions give each id it has seen a slot (a row); an id it has not seen
looks up the table's default row. Example::

    tables:
      - {name: t_user, rows: 100000, dim: 64, features: [user_id], ids: raw,
         remap: {kind: mch, eviction: lfu, eviction_interval: 1}}

``kind: mch`` is TorchRec's ``MCHManagedCollisionModule`` (sorted raw ids; its eviction policy and
interval are the training's: they decide which of its state a checkpoint holds); ``unseen``
is what an id the model has not seen scores with.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator


class IdSpace(str, enum.Enum):
    """What a table's ids are: row indexes (``0..rows-1``, or hashed by ``out_of_range``), or raw
    64-bit ids mapped to rows by managed collisions (``remap``)."""

    INDEX = "index"
    RAW = "raw"


class RemapKind(str, enum.Enum):
    MCH = "mch"  # TorchRec's MCHManagedCollisionModule: sorted raw ids, evicted by a policy
    ZCH = "zch"  # TorchRec's HashZchManagedCollisionModule: zero-collision hashing


class MchEviction(str, enum.Enum):
    """The MCH eviction policy the table was trained with (its state's metadata follows it)."""

    LFU = "lfu"
    LRU = "lru"
    DISTANCE_LFU = "distance_lfu"


class Unseen(str, enum.Enum):
    """What an id the model has not seen looks up: the table's default row (MCH's reserved last
    slot, trained on every id outside the table), or a zero row (that slot held at zero: the id
    adds nothing to a sum; a mean still counts it)."""

    DEFAULT_ROW = "default_row"
    ZERO = "zero"


class RemapSpec(BaseModel):
    """A raw-id table's id-to-slot mapping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: RemapKind = Field(description="mch: TorchRec's MCH module (sorted raw ids, eviction by policy)")
    eviction: MchEviction = Field(MchEviction.LFU, description="mch: the eviction policy of the training")
    eviction_interval: StrictInt = Field(1, gt=0, description="mch: training steps between evictions")
    unseen: Unseen = Field(Unseen.DEFAULT_ROW, description="what an id the model has not seen looks up")

    @model_validator(mode="after")
    def _served(self) -> "RemapSpec":
        if self.kind != RemapKind.MCH:
            raise ValueError(f"kind: {self.kind.value} tables are not served yet; mch is")
        return self
