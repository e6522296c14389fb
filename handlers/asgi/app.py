"""The ASGI application of one server process: Starlette over the routes (``routes.py``), behind
the key check (``auth.py``); its models loaded at startup (``registry.py``), before the process
takes its first connection, with one forward thread that all of them share.

Every process of a server builds its own from the same ``EngineSettings``, which the launching
process puts in its environment (``ENGINE_ENV``) for uvicorn's worker processes:

    os.environ[ENGINE_ENV] = EngineSettings((Path("/tmp/x/tiny"),), Path("keys.json")).to_env()
    uvicorn.run("handlers.asgi.app:app_from_environment", factory=True, workers=4)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator

import orjson
from starlette.applications import Starlette

from handlers.asgi.auth import KeyCheck, KeyFile
from handlers.asgi.metrics import EngineMetrics, read_every
from handlers.asgi.registry import ModelRegistry
from handlers.asgi.routes import ROUTES

ENGINE_ENV = "TORCHREC_SERVE_ASGI"


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """``folders``: the unpacked archives to serve; ``key_file``: the inference key (``auth.py``)."""

    folders: tuple[Path, ...]
    key_file: Path

    def to_env(self) -> str:
        return orjson.dumps({"folders": [str(f) for f in self.folders], "key_file": str(self.key_file)}).decode()

    @classmethod
    def from_env(cls) -> "EngineSettings":
        raw = orjson.loads(os.environ[ENGINE_ENV])
        return cls(tuple(Path(f) for f in raw["folders"]), Path(raw["key_file"]))


def create_app(settings: EngineSettings) -> KeyCheck:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        forwards = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")  # one forward at a time
        models = ModelRegistry.load(settings.folders, forwards, EngineMetrics())
        gc.collect()
        gc.freeze()  # the loaded objects out of the collector's walks (as the TorchServe adapter does)
        app.state.models = models
        for model in models.models:
            model.batcher.start()
        readers = [
            asyncio.create_task(read_every(m.read_raw_ids, m.metrics_every_s, forwards))
            for m in models.models if m.read_raw_ids is not None
        ]
        try:
            yield
        finally:
            for reader in readers:
                reader.cancel()
            for model in models.models:
                await model.batcher.stop()
            forwards.shutdown(wait=True)

    return KeyCheck(Starlette(routes=ROUTES, lifespan=lifespan), KeyFile(settings.key_file).key())


def app_from_environment() -> KeyCheck:
    """uvicorn's factory, in each server process."""
    return create_app(EngineSettings.from_env())
