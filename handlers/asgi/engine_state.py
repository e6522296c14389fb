"""The models a multi-process ASGI server should serve, as files in its state folder, which every
process reconciles (``reconcile.py``): a management call changes the wanted state under a lock and
raises its generation; each process, once it serves that generation, notes it.

    <state>/wanted.json      {"generation": 3, "models": [{"archive": "tiny.mar", "folder": "..."}],
                              "defaults": {"tiny": "2.0"}}
    <state>/processes/<pid>.json   {"pid": 4242, "generation": 3}

    state = EngineState(Path("/tmp/engine-state"))
    with state.changing() as wanted:        # one change at a time, across the processes
        wanted.models.append(WantedModel("tiny.mar", str(folder)))
    behind = state.behind(wanted.generation)   # live processes not serving it yet
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
from pathlib import Path
from typing import Iterator

import orjson

from handlers.runtime.freshness.protocol import write_whole

WANTED = "wanted.json"
PROCESSES = "processes"


@dataclasses.dataclass(frozen=True)
class WantedModel:
    """``archive``: its name in the model store; ``folder``: where the engine placed it."""

    archive: str
    folder: str


@dataclasses.dataclass
class Wanted:
    generation: int = 0
    models: list[WantedModel] = dataclasses.field(default_factory=list)
    defaults: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> default version


class EngineState:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def read(self) -> Wanted:
        try:
            raw = orjson.loads((self.folder / WANTED).read_bytes())
        except FileNotFoundError:
            return Wanted()
        return Wanted(raw["generation"], [WantedModel(**m) for m in raw["models"]], dict(raw["defaults"]))

    @contextlib.contextmanager
    def changing(self) -> Iterator[Wanted]:
        """The wanted state to change in place; written whole, one generation on, unless the
        block raises."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "wanted.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            wanted = self.read()
            yield wanted
            wanted.generation += 1
            write_whole(self.folder / WANTED, orjson.dumps(dataclasses.asdict(wanted)))

    def note_served(self, generation: int) -> None:
        """This process serves ``generation``."""
        folder = self.folder / PROCESSES
        folder.mkdir(parents=True, exist_ok=True)
        write_whole(folder / f"{os.getpid()}.json", orjson.dumps({"pid": os.getpid(), "generation": generation}))

    def processes(self) -> dict[int, int]:
        """The live processes that noted a generation: pid -> the generation each serves."""
        served = {}
        for note in (self.folder / PROCESSES).glob("*.json"):
            try:
                pid = int(note.stem)
                os.kill(pid, 0)
                served[pid] = orjson.loads(note.read_bytes())["generation"]
            except (ProcessLookupError, ValueError, FileNotFoundError, orjson.JSONDecodeError):
                continue
        return served

    def behind(self, generation: int) -> list[int]:
        return sorted(pid for pid, served in self.processes().items() if served < generation)
