"""One server process bringing the models it serves to the wanted state (``engine_state.py``):
at start, before it takes a connection; on a short poll; and at once in the process that
answers a management call. Models are loaded off the event loop (a load takes seconds) and
removed once no request can reach them (their batchers stopped).

    reconciler = Reconciler(EngineState(state_dir), models, forwards)
    await reconciler.apply()          # the wanted generation served; noted for the others
    reconciler.start()                # then polls every POLL_S
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from concurrent.futures import Executor
from pathlib import Path
from typing import AsyncIterator

from handlers.asgi.engine_state import EngineState, Wanted
from handlers.asgi.metrics import EngineMetrics, read_every
from handlers.asgi.registry import ModelRegistry, ServedModel, freeze_loaded, load_model

logger = logging.getLogger(__name__)

POLL_S = 0.5


class Reconciler:
    def __init__(
        self, state: EngineState, models: ModelRegistry, forwards: Executor, metrics: EngineMetrics | None = None
    ) -> None:
        self.state = state
        self.models = models
        self.forwards = forwards
        self.metrics = metrics  # where a model registered later is counted
        self.generation = -1  # none served yet
        self.lock = asyncio.Lock()  # one change of this process's models at a time
        self._task: asyncio.Task | None = None
        self._readers: dict[int, asyncio.Task] = {}  # the metrics readers of the models it loaded

    async def apply(self) -> None:
        async with self.lock:
            await self._apply(self.state.read())

    @contextlib.asynccontextmanager
    async def changing(self) -> AsyncIterator[None]:
        """A management call's change: the poll waits meanwhile; the wanted state is served after."""
        async with self.lock:
            yield
            await self._apply(self.state.read())

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.apply()
            except Exception:  # a model that fails to load here: logged, tried again next poll
                logger.exception("reconciling the served models with %s failed", self.state.folder)

    async def _apply(self, wanted: Wanted) -> None:
        if wanted.generation == self.generation:
            return
        loaded = {str(m.folder): m for m in self.models.models}
        folders = [m.folder for m in wanted.models]
        for folder in folders:
            if folder not in loaded:
                await self.load(Path(folder))
        for folder, model in loaded.items():
            if folder not in folders:
                await self.unload(model)
        self.models.defaults = dict(wanted.defaults)
        self.generation = wanted.generation
        self.state.note_served(wanted.generation)

    async def load(self, folder: Path) -> ServedModel:
        load = functools.partial(load_model, folder, self.forwards, self.metrics)
        model = await asyncio.get_running_loop().run_in_executor(None, load)
        freeze_loaded()
        self.models.add(model)
        model.batcher.start()
        if model.read_raw_ids is not None:  # a raw-id model's counts, read as at start (app.py)
            self._readers[id(model)] = asyncio.create_task(
                read_every(model.read_raw_ids, model.metrics_every_s, self.forwards)
            )
        return model

    async def unload(self, model: ServedModel) -> None:
        """No new request reaches it; those it holds are answered first. Its freshness threads
        (if it takes deltas) stay until the process ends."""
        self.models.remove(model)
        reader = self._readers.pop(id(model), None)
        if reader is not None:
            reader.cancel()
        await model.batcher.drain()
        await model.batcher.stop()
