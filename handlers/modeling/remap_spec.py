"""How a raw-id table maps 64-bit feature ids to its rows: a table's ``remap`` section.

A table with ``ids: raw`` takes any int64 id (user, item or ad ids, hashes of strings) and
TorchRec's managed collisions give each id it has seen a slot (a row). Examples::

    tables:
      - {name: t_user, rows: 100000, dim: 64, features: [user_id], ids: raw,
         remap: {kind: mch, eviction: lfu, eviction_interval: 1}}
      - {name: t_item, rows: 100000, dim: 64, features: [item_id], ids: raw,
         remap: {kind: zch, max_probe: 128, buckets: 1}}

``kind: mch`` is TorchRec's ``MCHManagedCollisionModule`` (sorted raw ids; its eviction policy and
interval are the training's: they decide which of its state a checkpoint holds); ``kind: zch`` its
``HashZchManagedCollisionModule`` (zero-collision hashing: an id's slot is found by probing from
its hash, at most ``max_probe`` slots, within its bucket, ``id mod buckets``). ``unseen`` is what
an id the model has not seen scores with.
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    model_serializer,
    model_validator,
)

from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT


class IdSpace(str, enum.Enum):
    """What a table's ids are: row indexes (``0..rows-1``, or hashed by ``out_of_range``), or raw
    64-bit ids mapped to rows by managed collisions (``remap``)."""

    INDEX = "index"
    RAW = "raw"


class RemapKind(str, enum.Enum):
    MCH = "mch"  # TorchRec's MCHManagedCollisionModule: sorted raw ids, evicted by a policy
    ZCH = "zch"  # TorchRec's HashZchManagedCollisionModule: zero-collision hashing


# the raw id each kind marks a free slot with: its tables' features refuse it
RESERVED_RAW_ID = {RemapKind.MCH: MCH_FREE_SLOT, RemapKind.ZCH: ZCH_EMPTY_SLOT}


class MchEviction(str, enum.Enum):
    """The MCH eviction policy the table was trained with (its state's metadata follows it)."""

    LFU = "lfu"
    LRU = "lru"
    DISTANCE_LFU = "distance_lfu"


class Unseen(str, enum.Enum):
    """What an id the model has not seen looks up. mch: the table's default row (its reserved
    last slot, trained on every id outside the table), or a zero row (that slot held at zero: the
    id adds nothing to a sum; a mean still counts it). zch has no reserved slot: an unseen id looks
    up the slot its probing starts at (``probe_slot``, TorchRec's eval behaviour), another id's row
    or a never-assigned one; or no row at all (``zero``: the id is left out of its bag, so it adds
    nothing to a sum and a mean does not count it)."""

    DEFAULT_ROW = "default_row"
    ZERO = "zero"
    PROBE_SLOT = "probe_slot"


_SETTINGS = {RemapKind.MCH: {"eviction", "eviction_interval"}, RemapKind.ZCH: {"max_probe", "buckets"}}
_UNSEEN = {RemapKind.MCH: (Unseen.DEFAULT_ROW, Unseen.ZERO), RemapKind.ZCH: (Unseen.PROBE_SLOT, Unseen.ZERO)}


class RemapSpec(BaseModel):
    """A raw-id table's id-to-slot mapping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: RemapKind = Field(description="mch: TorchRec's MCH module (sorted raw ids); zch: its zero-collision hashing")
    eviction: MchEviction = Field(MchEviction.LFU, description="mch: the eviction policy of the training")
    eviction_interval: StrictInt = Field(1, gt=0, description="mch: training steps between evictions")
    max_probe: StrictInt = Field(128, gt=0, description="zch: the most slots probed for an id")
    buckets: StrictInt = Field(
        1, gt=0, description="zch: the training's buckets (total_num_buckets); rows split evenly"
    )
    unseen: Unseen | None = Field(
        None,  # filled by kind: mch default_row, zch probe_slot
        description="what an id the model has not seen looks up: mch default_row (null: the default) "
        "or zero (a zero row); zch probe_slot (null: the default) or zero (no row: left out of its bag)",
    )

    @property
    def zero_row(self) -> bool:
        """An MCH table with ``unseen: zero``: its default row (the last slot) is held at zero."""
        return self.kind == RemapKind.MCH and self.unseen == Unseen.ZERO

    @property
    def drops_unseen(self) -> bool:
        """A ZCH table with ``unseen: zero``: an unseen id looks up no row (left out of its bag)."""
        return self.kind == RemapKind.ZCH and self.unseen == Unseen.ZERO

    @model_validator(mode="before")
    @classmethod
    def _unseen_by_kind(cls, given: Any) -> Any:
        if isinstance(given, dict) and given.get("unseen") is None and given.get("kind") in ("mch", "zch"):
            return {**given, "unseen": _UNSEEN[RemapKind(given["kind"])][0]}
        return given

    @model_serializer(mode="wrap")
    def _without_other_kinds_settings(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        other = next(k for k in RemapKind if k != self.kind)
        return {k: v for k, v in handler(self).items() if k not in _SETTINGS[other]}

    @model_validator(mode="after")
    def _settings_of_its_kind(self) -> "RemapSpec":
        other = next(k for k in RemapKind if k != self.kind)
        foreign = sorted(_SETTINGS[other] & self.model_fields_set)
        if foreign:
            raise ValueError(f"{foreign[0]}: a setting of {other.value} tables, not {self.kind.value}")
        if self.unseen not in _UNSEEN[self.kind]:
            served = " or ".join(u.value for u in _UNSEEN[self.kind])
            given = self.unseen.value  # type: ignore[union-attr]
            raise ValueError(f"unseen: {self.kind.value} tables serve {served}, not {given}")
        return self
