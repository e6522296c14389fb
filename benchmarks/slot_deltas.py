"""Slot deltas in the ``raw_ids`` scenarios: how long moving slots between raw ids takes on a
large table, and whether any served score ever saw an id with another id's row.

* ``swap_figures``: in process, the writer's own steps (``freshness.slot_writes``) on the raw-id
  archive's weights file, for ``evictions`` random slots given to new raw ids (their rows kept):
  the new slot map rebuilt, its changed span staged in a file in shared memory and its pages
  made writable, outside the lock (``stage_s``), then that span and the rows copied under the row lock (``lock_ms``, what a
  forward can wait); ``swap_s`` is both. Checked:
  the served remap, reading the file through its own mapping, maps each new id to its slot.
* ``torn_pairs``: through TorchServe, ids A and B swap two slots of one table, each taking its row
  along, delta after delta (published through the plugin), while one-item requests that look up
  A alone keep coming: every score must be A's; a score that is not counts as a torn pair.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from archive_tools.delta import served_rows
from archive_tools.local_server import LocalTorchServe
from handlers.modeling.raw_ids import first_probe_slots, served_remap
from handlers.modeling.spec import TableSpec
from handlers.modeling.registry import load_spec
from handlers.runtime.freshness.applier import RowLock, TableWriter
from handlers.runtime.freshness.delta_file import DeltaWriter, record_dtype
from handlers.runtime.freshness.layout import TableLayout, TablesLayout, table_buffers
from handlers.runtime.freshness.slot_writes import stage
from handlers.runtime.slot_maps import SlotMap, is_hashed, owners_of, slot_maps_in

SCORE_TOLERANCE = 1e-6  # one row, the same bytes each time: the score repeats exactly


def swap_figures(archive: Path, weights_file: Path, spec: TableSpec, evictions: int, seed: int) -> dict:
    """Moves ``evictions`` slots of table ``spec`` to new raw ids in the archive's own weights file
    (a scratch archive: it is changed): random slots (MCH), or the slots the new ids' probing
    starts at (ZCH, whose lookup finds them there)."""
    table = spec.name
    layout = TablesLayout.load(archive)
    served = layout.table(table)
    assert served is not None and served.raw_ids, f"{table} is not a raw-id table of {archive}"
    weights = torch.load(weights_file, mmap=True, weights_only=True)
    maps = slot_maps_in(weights)
    writer = TableWriter(weights_file, table_buffers(weights, layout.buffer_constants), layout, maps)
    rng = np.random.default_rng(seed)
    new_ids = _new_ids(2 * evictions, np.sort(owners_of(maps[table]).numpy()), rng)
    if is_hashed(maps[table]):
        first = first_probe_slots(torch.from_numpy(new_ids), served.rows, spec.remap.buckets).numpy()  # type: ignore[union-attr]
        slots, index = np.unique(first, return_index=True)  # one new id a slot
        chosen = rng.choice(len(slots), evictions, replace=False)
        slots, owners = slots[chosen], new_ids[index[chosen]]
    else:
        slots, owners = rng.choice(served.rows - 1, evictions, replace=False), new_ids[:evictions]
    order = np.argsort(slots)
    records = np.empty(evictions, record_dtype(served.row_bytes, owners=True))
    records["id"], records["owner"] = slots[order], owners[order]
    records["row"] = writer.rows(table, records["id"])
    with tempfile.TemporaryDirectory(prefix="swap-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as folder:
        started = time.perf_counter()
        staged = stage(writer, table, records, key="swap")
        staged.save(Path(folder) / "staged-map.pt")  # as the writer keeps it beside the working copy
        writer.touch(table, records["id"])  # as an unpinned writer does (slot_writes.write_slots)
        writer.touch_map(table, staged)
        staged_at = time.perf_counter()
        with RowLock(Path(folder)).writing():
            writer.write(table, records, staged)
            done = time.perf_counter()
    remap = served_remap(spec)
    remap.load({table: maps[table]})  # this process's own mapping of the file
    slots = remap.first_feature(torch.from_numpy(records["owner"].copy()))
    if not np.array_equal(slots.numpy(), records["id"]):
        raise AssertionError(f"{table}: the new ids do not map to their slots after the swap")
    return {"slots": served.rows, "evictions": evictions, "stage_s": staged_at - started,
            "lock_ms": (done - staged_at) * 1e3, "swap_s": done - started}


def _new_ids(count: int, owned: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct random int64 ids that own no slot (``owned``: sorted)."""
    ids = np.unique(rng.integers(-(2**62), 2**62, size=2 * count, dtype=np.int64))
    found = owned[np.minimum(np.searchsorted(owned, ids), len(owned) - 1)] == ids
    ids = rng.permutation(ids[~found])
    if len(ids) < count:
        raise AssertionError("drew too few new ids")
    return ids[:count]


def torn_pairs(server: LocalTorchServe, model: str, archive: Path, weights_file: Path, table: str, publishes: int) -> dict:
    """Publishes ``publishes`` deltas that swap two ids' slots under one-item traffic for one of
    them to ``model`` (registered from ``archive``, whose tables ``weights_file`` holds; its log
    empty), and unregisters it."""
    layout, spec = TablesLayout.load(archive), load_spec(archive / "spec.yaml")
    served = layout.table(table)
    assert served is not None
    table_spec = next(t for t in spec.tables if t.name == table)
    slots, (a, b) = _swapped_pair(table_spec, slot_maps_in(torch.load(weights_file, mmap=True, weights_only=True))[table])
    rows = {a: served_rows(torch.full((1, served.dim), 0.75), served), b: served_rows(torch.full((1, served.dim), -0.75), served)}
    folder = server.model_store / "deltas"
    folder.mkdir(exist_ok=True)
    try:
        def request(raw_id: int) -> dict:
            return {"items": [{"dense": [0.5] * spec.dense_features, "sparse": {table_spec.features[0]: [raw_id]}}]}

        return _probe(server, model, served, layout.fingerprint, slots, rows, request, publishes) | {"torn_probe_table": table}
    finally:
        server.management("DELETE", f"/models/{model}").raise_for_status()


def _swapped_pair(table: TableSpec, served: SlotMap) -> tuple[np.ndarray, tuple[int, int]]:
    """Two slots and two raw ids that can swap them: MCH, the owners of slots 0 and 1; ZCH, two
    new ids whose probing starts at the same slot, and that slot and the next (each id found in
    either)."""
    if not is_hashed(served):
        owners = owners_of(served)
        return np.array([0, 1]), (int(owners[0]), int(owners[1]))
    rows, buckets = len(served[0]), table.remap.buckets  # type: ignore[union-attr]
    ids = torch.from_numpy(_new_ids(4 * int(rows**0.5) + 100, np.sort(owners_of(served).numpy()), np.random.default_rng(5)))
    first = first_probe_slots(ids, rows, buckets)
    order = torch.argsort(first, stable=True)
    same = torch.nonzero(first[order][1:] == first[order][:-1]).flatten()
    if not len(same):
        raise AssertionError(f"{table.name}: no two new ids start probing at one slot; draw more")
    a, b = order[same[0]], order[same[0] + 1]
    start, size = (int(first[a]) // (rows // buckets)) * (rows // buckets), rows // buckets
    return np.array([int(first[a]), start + (int(first[a]) - start + 1) % size]), (int(ids[a]), int(ids[b]))


def _probe(server: LocalTorchServe, model: str, served: TableLayout, base: str, slots: np.ndarray,
           rows: dict[int, np.ndarray], request: Callable[[int], dict], publishes: int) -> dict:
    """The torn-pair probe: ids ``a`` and ``b`` (``rows``' keys, with their rows) swap ``slots``
    of table ``served`` delta after delta while ``request(a)`` (one item, a alone) keeps coming."""
    a, b = list(rows)
    folder = server.model_store / "deltas"

    def publish(sequence: int) -> None:
        owners = np.array([a, b] if sequence % 2 else [b, a])
        order = np.argsort(slots)  # a delta's slots in order (ZCH's second may wrap to its bucket's first)
        name = f"{model}-torn-{sequence}.delta"
        with DeltaWriter(folder / name, model=model, base=base, sequence=sequence) as out:
            out.add(served, slots[order], np.concatenate([rows[int(o)] for o in owners[order]]), owners[order])
        server.management("POST", f"/freshness/{model}", params={"delta": name}).raise_for_status()
        _wait_applied(server, model, sequence)

    def score(raw_id: int) -> float:
        response = server.predict(model, request(raw_id))
        response.raise_for_status()
        return response.json()["scores"][0]

    publish(1)
    expected, other = score(a), score(b)
    if abs(expected - other) < 100 * SCORE_TOLERANCE:
        raise AssertionError(f"A's and B's rows score alike ({expected}, {other}): the probe could not see a torn pair")
    scores: list[float] = []
    stop = threading.Event()

    def send() -> None:
        while not stop.is_set():
            scores.append(score(a))

    sender = threading.Thread(target=send, name="torn-probe")
    sender.start()
    try:
        for sequence in range(2, publishes + 2):
            publish(sequence)
    finally:
        stop.set()
        sender.join()
    torn = sum(abs(s - expected) > SCORE_TOLERANCE for s in scores)
    return {"torn_pairs": torn, "torn_probe_requests": len(scores), "torn_probe_publishes": publishes}


def _wait_applied(server: LocalTorchServe, model: str, sequence: int, timeout_s: float = 120) -> None:
    server.freshness_when(model, lambda state: state["applied_sequence"] >= sequence, timeout_s)
