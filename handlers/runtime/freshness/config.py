"""The model config's ``freshness`` section, parsed once when a worker loads::

    freshness:
      rows_per_s: 80000                  # the writer's pace
      chunk_rows: 4096                   # rows written per hold of the row lock
      tables_dir: /dev/shm/torchrec-serve  # where the tables' working copy goes (default; where it
                                         # lacks the room, the system's temporary folder)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from handlers.runtime.errors import InputError
from handlers.runtime.freshness.applier import Pace
from handlers.runtime.freshness.shared_tables import ROOTS


@dataclasses.dataclass(frozen=True)
class FreshnessConfig:
    pace: Pace = Pace()
    tables_roots: tuple[Path, ...] = ROOTS  # tried in order

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> "FreshnessConfig":
        raw = dict(raw or {})
        unknown = set(raw) - {"rows_per_s", "chunk_rows", "tables_dir"}
        if unknown:
            raise InputError(f"freshness: unknown keys {sorted(unknown)}")
        pace = Pace(float(raw.get("rows_per_s", Pace.rows_per_s)), int(raw.get("chunk_rows", Pace.chunk_rows)))
        if pace.rows_per_s <= 0 or pace.chunk_rows <= 0:
            raise InputError(f"freshness: rows_per_s and chunk_rows must be positive, got {raw}")
        roots = ROOTS if "tables_dir" not in raw else (Path(raw["tables_dir"]), *ROOTS[1:])
        return cls(pace, roots)
