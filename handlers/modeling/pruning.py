"""Pruned tables: a table that serves only the rows of the ids it keeps (``tables[].pruned_to``).

The spec's ``pruning`` file holds, per pruned table, the ids that keep a row, ascending (int64)::

    torch.save({"t_user": torch.tensor([0, 3, 4, 17, ...])}, "criteo.pruning.pt")

The served table holds those rows in that order (TorchRec's ``num_embeddings_post_pruning``), and
FBGEMM's kernels look every id up through an index remapping (``remapping``: id -> its row, or -1):
an id that was pruned looks up nothing, so it adds a zero row to its bag (a mean still counts it).
A delta's ids are the table's ids; ``rows_of`` turns them into rows and refuses pruned ones.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from handlers.modeling.errors import SpecError
from handlers.modeling.spec import ModelSpec, TableSpec


def kept_ids(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Each pruned table's kept ids (int64, ascending), checked against the spec; {} unpruned."""
    if spec.pruning is None:
        return {}
    path = Path(spec.pruning)
    try:
        version = (path.stat().st_mtime_ns, path.stat().st_size)  # a rewritten file is read again
    except FileNotFoundError:
        raise SpecError(f"pruning: {path}: no such file") from None
    unpruned = tuple(t.name for t in spec.tables if not t.pruned_to)
    return _read(path, version, tuple((t.name, t.rows, t.pruned_to) for t in spec.tables if t.pruned_to), unpruned)


@functools.lru_cache(maxsize=4)
def _read(
    path: Path, version: tuple[int, int], tables: tuple[tuple[str, int, int], ...], unpruned: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """The kept ids of ``tables`` (name, rows, pruned_to); the file may hold other models' tables
    (a distributed layout's other shards), not one of ``unpruned``."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file, or not plain tensors
        raise SpecError(f"pruning: {path}: not a file of kept ids torch can load: {str(e).splitlines()[0]}") from None
    if not isinstance(saved, dict):
        raise SpecError(f"pruning: {path}: must map each pruned table to its kept ids")
    kept = {}
    for name, rows, pruned_to in tables:
        ids = saved.get(name)
        where = f"pruning: {path}: table {name}"
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise SpecError(f"{where}: needs its kept ids as a 1-d int64 tensor")
        if len(ids) != pruned_to:
            raise SpecError(f"{where}: keeps {len(ids)} ids, the spec's pruned_to is {pruned_to}")
        if len(ids) and (int(ids[0]) < 0 or int(ids[-1]) >= rows or not bool((ids[1:] > ids[:-1]).all())):
            raise SpecError(f"{where}: ids must be distinct, ascending and in 0..{rows - 1}")
        kept[name] = ids
    extra = sorted(set(saved) & set(unpruned))
    if extra:
        raise SpecError(f"pruning: {path}: tables {extra} are not pruned in the spec (tables[].pruned_to)")
    return kept


def remapping(kept: torch.Tensor, table: TableSpec) -> torch.Tensor:
    """int32 [rows]: each id's row in the pruned table, -1 for an id that was pruned."""
    remap = torch.full((table.rows,), -1, dtype=torch.int32)
    remap[kept] = torch.arange(len(kept), dtype=torch.int32)
    return remap


def rows_of(ids: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` -> (their rows in the pruned table, whether each id was kept)."""
    rows = torch.searchsorted(kept, ids).clamp_max(max(len(kept) - 1, 0))
    found = kept[rows] == ids if len(kept) else torch.zeros_like(ids, dtype=torch.bool)
    return rows, found
