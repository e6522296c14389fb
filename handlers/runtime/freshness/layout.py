"""Where each table's rows lie in the served weights, as FBGEMM lays them out, and the
fingerprint of the rows an archive was built with.

``tables.json`` (written into every archive by the build)::

    {"fingerprint": "sha256 of the table buffers and dense tensors",
     "tables": [{"name": "cat_0", "dtype": "int8", "dim": 64, "rows": 100000,
                 "row_bytes": 68, "buffer": 0, "offset": 0}, ...]}

A table's row ``i`` is the ``row_bytes`` bytes at ``offset + i * row_bytes`` of TBE buffer
``buffer``: for int8/int4/int2 an fp16 scale and an fp16 bias, then the packed values; for fp16/fp32
the values; padded with zeros to FBGEMM's row alignment. A delta carries whole rows in this form.
A raw-id table (``"raw_ids": true``) also has a slot map in the weights file
(``handlers.runtime.slot_maps``), which a delta changes with the rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import orjson
import torch

from handlers.runtime.archive_files import TABLES


# The TBE buffers' keys in a served weights file: ``tbe.0`` in weights.pt, and
# ``<module path>.tbes.0.weights_host`` among a compiled package's constants.
_BUFFER_KEY = re.compile(r"(?:^tbe\.(\d+)$)|(?:\.tbes\.(\d+)\.weights_host$)")
_WEIGHTS_PT_KEY = re.compile(r"^tbe\.\d+$")


@dataclasses.dataclass(frozen=True)
class TableLayout:
    name: str
    dtype: str  # the served dtype: fp32, fp16, int8, int4, int2
    dim: int
    rows: int
    row_bytes: int
    buffer: int  # which TBE buffer
    offset: int  # byte offset of row 0 in it
    raw_ids: bool = False  # its rows are slots that raw ids own: a delta's records name their owners


@dataclasses.dataclass(frozen=True)
class TablesLayout:
    """``sharded``: the spec shards its tables, so each worker copies them at load (no delta
    reaches such copies); ``buffer_constants``: for a compiled package, the names of its TBE
    buffer constants in buffer order (``model.item_embeddings.tbes.0.weights_host``), written at
    capture; empty where the tables are in ``weights.pt`` (keys ``tbe.0``, ...)."""

    fingerprint: str
    tables: tuple[TableLayout, ...]
    sharded: bool = False
    buffer_constants: tuple[str, ...] = ()

    def table(self, name: str) -> TableLayout | None:
        return next((t for t in self.tables if t.name == name), None)

    def save(self, folder: Path) -> None:
        (Path(folder) / TABLES).write_bytes(
            orjson.dumps(
                {"fingerprint": self.fingerprint, "sharded": self.sharded,
                 "tables": [dataclasses.asdict(t) for t in self.tables], "buffer_constants": list(self.buffer_constants)},
                option=orjson.OPT_INDENT_2,
            )
        )

    @classmethod
    def load(cls, folder: Path) -> "TablesLayout":
        raw = orjson.loads((Path(folder) / TABLES).read_bytes())
        return cls(
            raw["fingerprint"], tuple(TableLayout(**t) for t in raw["tables"]), bool(raw.get("sharded")),
            tuple(raw.get("buffer_constants", ())),
        )


def table_buffers(weights: Mapping[str, torch.Tensor], constants: Sequence[str] = ()) -> list[torch.Tensor]:
    """The TBE buffers of a loaded weights file (weights.pt, or a compiled package's), in order: a
    compiled package's by their constant names where the layout gives them
    (``TablesLayout.buffer_constants``; archives built before it hold one collection, numbered)."""
    if constants and not any(_WEIGHTS_PT_KEY.match(k) for k in weights):
        missing = [name for name in constants if name not in weights]
        if missing:
            raise ValueError(f"the weights hold no table constants {missing}")
        return [weights[name] for name in constants]
    found: dict[int, torch.Tensor] = {}
    for key, tensor in weights.items():
        match = _BUFFER_KEY.search(key)
        if match:
            found[int(match.group(1) or match.group(2))] = tensor
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"TBE buffers {sorted(found)} are not numbered 0..{len(found) - 1}")
    return [found[i] for i in range(len(found))]


def fingerprint(buffers: Iterable[torch.Tensor], dense: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the table buffers (in order) and the dense tensors (by name): what a delta's
    ``base`` must equal."""
    sha = hashlib.sha256()
    for buffer in buffers:
        flat = buffer.contiguous().view(torch.uint8).reshape(-1)
        for start in range(0, flat.numel(), 64 << 20):  # the buffer is mapped: read in pieces
            sha.update(flat[start : start + (64 << 20)].numpy().data)
    for name in sorted(dense):
        tensor = dense[name].detach().contiguous()
        sha.update(name.encode())
        sha.update(str(tensor.dtype).encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return sha.hexdigest()
