"""The ASGI application of one server process: Starlette over the routes (``routes.py``), behind
the key check (``auth.py``); its models loaded at startup (``registry.py``), before the process
takes its first connection, with one forward thread that all of them share; then, where a gRPC
port is given, the Open Inference Protocol's gRPC service over the same models (``grpc_v2.py``).

Every process of a server builds its own from the same ``EngineSettings``, which the launching
process puts in its environment (``settings.py``) for uvicorn's worker processes:

    os.environ[ENGINE_ENV] = EngineSettings((Path("/tmp/x/tiny"),), Path("keys.json")).to_env()
    uvicorn.run("handlers.asgi.factory:app_from_environment", factory=True, workers=4)
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

from starlette.applications import Starlette

from handlers.asgi import grpc_v2
from handlers.asgi.auth import KeyCheck
from handlers.asgi.engine_state import EngineState
from handlers.asgi.key_file import KeyFile
from handlers.asgi.management import MANAGEMENT_ROUTES, Management
from handlers.asgi.metrics import EngineMetrics, read_every
from handlers.asgi.reconcile import Reconciler
from handlers.asgi.registry import ModelRegistry, freeze_loaded
from handlers.asgi.routes import ROUTES
from handlers.asgi.settings import EngineSettings


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
