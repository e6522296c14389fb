"""The ASGI engine's management routes, in the shape of TorchServe's management API and the
plugin's freshness endpoint (``archive_tools/plugin/java/.../ModelsEndpoint.java``,
``FreshnessEndpoint.java``), on the server's one port, behind the management key (``auth.py``):

    POST   /models?url=ARCHIVE                   register an archive of the model store by name
    GET    /models                               the models served, with their archives
    GET    /models/NAME[/VERSION|/all]           a model's default version, one version, or all
    DELETE /models/NAME[/VERSION]                unregister (the default only once it is the last)
    PUT    /models/NAME/VERSION/set-default      the version served without one in the path
    POST   /freshness/NAME[/VERSION]?delta=FILE  publish a delta of <model store>/deltas/
    POST   /freshness/NAME[/VERSION]?rollback_to=SEQUENCE
    GET    /freshness/NAME[/VERSION]             the applied sequence, the log's head, the processes

A change of the models reaches every process through the engine's state folder
(``engine_state.py``, ``reconcile.py``): the process answering loads a new model first (an
archive that fails is refused there, and nowhere else is it tried), then changes the wanted state,
and answers 200 once every live process serves it, or 202 after ``WAIT_S`` naming those behind
(they keep trying on their poll).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response as HttpResponse
from starlette.routing import Route

from handlers.asgi import publishing
from handlers.asgi.answers import json_answer, refusal
from handlers.asgi.engine_state import EngineState, WantedModel
from handlers.asgi.placing import place
from handlers.asgi.reconcile import Reconciler
from handlers.asgi.registry import ModelRegistry, ServedModel, manifest_model
from handlers.runtime.archive import Archive
from handlers.runtime.errors import BadRequest, Conflict, ModelNotFoundException, ServingError

WAIT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Management:
    """What the management routes of one process work on (``app.state.management``)."""

    store: Path
    state: EngineState
    reconciler: Reconciler

    @property
    def models(self) -> ModelRegistry:
        return self.reconciler.models


def _management(request: Request) -> Management:
    management = request.app.state.management
    if management is None:
        raise Conflict("this server was started without a model store to manage")
    return management


def _handled(endpoint):
    async def route(request: Request) -> HttpResponse:
        try:
            return await endpoint(request, _management(request))
        except ServingError as error:
            return refusal(error, v2=False)
    return route


async def _served_everywhere(state: EngineState, generation: int) -> list[int]:
    """The live processes that do not serve ``generation`` after up to ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while (behind := state.behind(generation)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return behind


def _changed(status: str, behind: list[int]) -> HttpResponse:
    if not behind:
        return json_answer({"status": status})
    return json_answer({"status": f"{status}; processes {behind} do not serve it yet", "behind": behind}, 202)


async def register(request: Request, m: Management) -> HttpResponse:
    url = request.query_params.get("url")
    if not url:
        raise BadRequest("url", "required: the name of an archive in the model store")
    folder = await run_in_threadpool(place, m.store, url, m.state.folder)
    name, version = manifest_model(Archive(folder))
    async with m.reconciler.changing():
        if _served(m.models, name, version):
            raise Conflict(f"Model version {version} is already registered for model {name}")
        model = await m.reconciler.load(folder)  # a broken archive is refused here, before the others try it
        try:
            with m.state.changing() as wanted:
                wanted.models.append(WantedModel(url, str(folder)))
        except BaseException:
            await m.reconciler.unload(model)
            raise
    behind = await _served_everywhere(m.state, m.state.read().generation)
    return _changed(f'Model "{name}" Version: {version} registered', behind)


async def unregister(request: Request, m: Management) -> HttpResponse:
    async with m.reconciler.changing():
        model = _model(request, m)
        others = [v for v in m.models.versions(model.name) if v != model.version]
        if others and model.version == m.models.default_version(model.name):
            raise Conflict(f"model {model.name} version {model.version} is its default: set another "
                           f"({', '.join(others)}) as default first")
        with m.state.changing() as wanted:
            wanted.models = [w for w in wanted.models if w.folder != str(model.folder)]
            if not others:
                wanted.defaults.pop(model.name, None)
    behind = await _served_everywhere(m.state, m.state.read().generation)
    return _changed(f'Model "{model.name}" unregistered', behind)


async def set_default(request: Request, m: Management) -> HttpResponse:
    async with m.reconciler.changing():
        model = _model(request, m)
        with m.state.changing() as wanted:
            wanted.defaults[model.name] = str(model.version)
    behind = await _served_everywhere(m.state, m.state.read().generation)
    return _changed(f'Default version successfully updated for model "{model.name}" to "{model.version}"', behind)


async def list_models(request: Request, m: Management) -> HttpResponse:
    archives = {w.folder: w.archive for w in m.state.read().models}
    listed = {}
    for model in m.models.models:
        listed.setdefault(model.name, archives.get(str(model.folder)))
    return json_answer({"models": [{"modelName": n, "modelUrl": u} for n, u in sorted(listed.items())]})


async def describe(request: Request, m: Management) -> HttpResponse:
    name, version = request.path_params["model"], request.path_params.get("version")
    if version == "all":
        m.models.get(name)
        chosen = [m.models.get(name, v) for v in m.models.versions(name)] or [m.models.get(name)]
    else:
        chosen = [m.models.get(name, version)]
    archives = {w.folder: w.archive for w in m.state.read().models}
    processes = sorted(m.state.processes().items())
    return json_answer([_description(model, archives, processes, m.models.default_version(name)) for model in chosen])


def _description(model: ServedModel, archives: dict[str, str], processes: list, default: str | None) -> dict[str, Any]:
    policy = model.batcher.policy
    return {
        "modelName": model.name, "modelVersion": model.version, "modelUrl": archives.get(str(model.folder)),
        "isDefault": model.version == default, "batchSize": policy.batch_size, "maxBatchDelay": policy.max_delay_ms,
        "workers": [{"pid": pid, "generation": generation} for pid, generation in processes],
    }


def _served(models: ModelRegistry, name: str, version: str | None) -> bool:
    try:
        models.get(name, version)
        return True
    except ModelNotFoundException:
        return False


def _model(request: Request, m: Management) -> ServedModel:
    return m.models.get(request.path_params["model"], request.path_params.get("version"))


async def freshness(request: Request, m: Management) -> HttpResponse:
    model = _model(request, m)
    query = request.query_params
    if request.method == "GET":
        return json_answer(await run_in_threadpool(publishing.state, model))
    if "rollback_to" in query:
        to = query["rollback_to"]
        if not to.isdigit():
            raise BadRequest("rollback_to", f"must be a sequence number, got {to!r}")
        return json_answer(await run_in_threadpool(publishing.rollback, model, int(to)))
    if "delta" not in query:
        raise BadRequest("delta", "required: the name of a file in the model store's deltas folder")
    return json_answer(await run_in_threadpool(publishing.publish, model, m.store, query["delta"]))


MANAGEMENT_ROUTES = [
    Route("/models", _handled(register), methods=["POST"]),
    Route("/models", _handled(list_models), methods=["GET"]),
    Route("/models/{model}", _handled(describe), methods=["GET"]),
    Route("/models/{model}/{version}", _handled(describe), methods=["GET"]),
    Route("/models/{model}", _handled(unregister), methods=["DELETE"]),
    Route("/models/{model}/{version}", _handled(unregister), methods=["DELETE"]),
    Route("/models/{model}/{version}/set-default", _handled(set_default), methods=["PUT"]),
    Route("/freshness/{model}", _handled(freshness), methods=["GET", "POST"]),
    Route("/freshness/{model}/{version}", _handled(freshness), methods=["GET", "POST"]),
]
