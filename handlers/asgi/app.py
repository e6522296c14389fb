"""The ASGI application of one server process: Starlette over the routes (``routes.py``), behind
the key check (``auth.py``); its models loaded at startup (``registry.py``), before the process
takes its first connection, with one forward thread that all of them share; then, where a gRPC
port is given, the Open Inference Protocol's gRPC service over the same models (``grpc_v2.py``).

Every process of a server builds its own from the same ``EngineSettings``, which the launching
process puts in its environment (``ENGINE_ENV``) for uvicorn's worker processes:

    os.environ[ENGINE_ENV] = EngineSettings((Path("/tmp/x/tiny"),), Path("keys.json")).to_env()
    uvicorn.run("handlers.asgi.factory:app_from_environment", factory=True, workers=4)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator, Callable

import orjson
from starlette.applications import Starlette

from handlers.asgi import grpc_v2
from handlers.asgi.auth import KeyCheck, KeyFile
from handlers.asgi.engine_state import EngineState
from handlers.asgi.management import MANAGEMENT_ROUTES, Management
from handlers.asgi.metrics import EngineMetrics, read_every
from handlers.asgi.reconcile import Reconciler
from handlers.asgi.registry import ModelRegistry, freeze_loaded
from handlers.asgi.routes import ROUTES

ENGINE_ENV = "TORCHREC_SERVE_ASGI"


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """``folders``: the unpacked archives to serve; ``key_file``: the keys (``auth.py``);
    ``store`` and ``state_dir``: the model store and the engine's state folder, for the
    management routes (``management.py``); each process serves the wanted state found there too.
    ``grpc_host``, ``grpc_port``: where the gRPC service listens (port 0: no gRPC)."""

    folders: tuple[Path, ...]
    key_file: Path
    store: Path | None = None
    state_dir: Path | None = None
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0

    def to_env(self) -> str:
        return orjson.dumps({
            "folders": [str(f) for f in self.folders], "key_file": str(self.key_file),
            "store": self.store and str(self.store), "state_dir": self.state_dir and str(self.state_dir),
            "grpc_host": self.grpc_host, "grpc_port": self.grpc_port,
        }).decode()

    @classmethod
    def from_env(cls) -> "EngineSettings":
        raw = orjson.loads(os.environ[ENGINE_ENV])
        optional = {k: Path(raw[k]) for k in ("store", "state_dir") if raw.get(k)}
        return cls(
            tuple(Path(f) for f in raw["folders"]), Path(raw["key_file"]), **optional,
            grpc_host=raw["grpc_host"], grpc_port=raw["grpc_port"],
        )


def create_app(settings: EngineSettings, loaded: Callable[[], None] = lambda: None) -> KeyCheck:
    """The engine's app; ``loaded`` is called once its models are loaded, before it serves."""
    keys = KeyFile(settings.key_file)
    key = keys.key()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        forwards = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")  # one forward at a time
        metrics = EngineMetrics()
        models = ModelRegistry.load(settings.folders, forwards, metrics)
        freeze_loaded()
        app.state.models = models
        for model in models.models:
            model.batcher.start()
        app.state.management = None
        if settings.store is not None and settings.state_dir is not None:
            reconciler = Reconciler(EngineState(settings.state_dir), models, forwards, metrics)
            await reconciler.apply()  # the models wanted now, before the first connection
            reconciler.start()
            app.state.management = Management(settings.store, reconciler.state, reconciler)
        loaded()
        readers = [  # the raw-id counts of the models loaded at start (the reconciler reads its own)
            asyncio.create_task(read_every(m.read_raw_ids, m.metrics_every_s, forwards))
            for m in models.models if m.read_raw_ids is not None
        ]
        grpc_server = None
        try:
            if settings.grpc_port:
                grpc_server = await grpc_v2.start(models, key, settings.grpc_host, settings.grpc_port)
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grpc_v2.GRACE_S)  # its calls answered while the batchers run
            for reader in readers:
                reader.cancel()
            if app.state.management is not None:
                await app.state.management.reconciler.stop()
            for model in models.models:
                await model.batcher.stop()
            forwards.shutdown(wait=True)

    return KeyCheck(Starlette(routes=ROUTES + MANAGEMENT_ROUTES, lifespan=lifespan), key, keys.management_key())
