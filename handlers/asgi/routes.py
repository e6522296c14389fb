"""The routes of the ASGI engine: TorchServe's inference API and the KServe v2 REST protocol.

    POST /predictions/{model}[/{version}]                  TorchServe's: bodies and answers unchanged
    POST /v2/models/{model}[/versions/{version}]/infer     KServe v2, JSON or binary tensors
    GET  /v2/models/{model}[/versions/{version}]           v2 metadata (metadata.py)
    GET  /v2/models/{model}[/versions/{version}]/ready     v2 model readiness
    GET  /v2/models/{model}[/versions/{version}]/stats     requests and batches (Triton's statistics
                                                           extension, in part; this process's counts)
    GET  /v2/health/live, /v2/health/ready, /ping          health, without a key (auth.OPEN_PATHS)
    GET  /metrics                                          Prometheus, every process's (metrics.py), without a key

An inference request is passed to the model's batcher as TorchServe's adapter passes it to the
runtime (``handlers.torchserve_handler._payload``): the body, ``Content-Type``,
``Content-Encoding`` and ``Inference-Header-Content-Length`` as an ``Arrival``. The body is read
up to the model's ``limits.max_request_bytes`` and no further: past it, or when
``Content-Length`` says so, the answer is the runtime's 413 (its JSON form on every route, as the
runtime answers a body it cannot read yet).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response as HttpResponse
from starlette.routing import Route

from handlers.asgi.answers import answer, json_answer, refusal
from handlers.asgi.connections import CONNECTIONS
from handlers.asgi.metadata import model_metadata
from handlers.asgi.metrics import scrape
from handlers.asgi.registry import ModelRegistry, ServedModel
from handlers.runtime.errors import PayloadTooLarge, ServingError
from handlers.runtime.wire.transport import FORM_TYPES, Arrival, too_large
from handlers.runtime.wire.v2_headers import HEADER_LENGTH


def _models(request: Request) -> ModelRegistry:
    return request.app.state.models


def _model(request: Request) -> ServedModel:
    return _models(request).get(request.path_params["model"], request.path_params.get("version"))


async def _infer(request: Request, v2: bool) -> HttpResponse:
    try:
        model = _model(request)
        arrival = await _arrival(request, model.service.schema.limits.max_request_bytes)
        with CONNECTIONS.waiting():
            response = await model.batcher.submit(arrival)
        return answer(response)
    except PayloadTooLarge as error:
        return refusal(error, v2=False)
    except ServingError as error:
        return refusal(error, v2)


async def _arrival(request: Request, max_bytes: int) -> Arrival:
    """The request as the runtime reads it; ``PayloadTooLarge`` without reading past ``max_bytes``.
    A form body goes as TorchServe hands it over, parsed into fields: no body (the runtime
    answers 415 with the fix)."""
    headers = request.headers
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(int(declared), max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large(None, max_bytes)
    content_type = headers.get("content-type")
    is_form = (content_type or "").split(";")[0].strip().lower() in FORM_TYPES
    return Arrival(
        body=None if is_form else body,
        content_type=content_type,
        content_encoding=headers.get("content-encoding"),
        header_length=headers.get(HEADER_LENGTH),
    )


async def predictions(request: Request) -> HttpResponse:
    return await _infer(request, v2=False)


async def v2_infer(request: Request) -> HttpResponse:
    return await _infer(request, v2=True)


async def v2_metadata(request: Request) -> HttpResponse:
    try:
        model = _model(request)
    except ServingError as error:
        return refusal(error, v2=True)
    versions = [model.version] if "version" in request.path_params else _models(request).versions(model.name)
    return json_answer(model_metadata(model.service.schema, model.name, [v for v in versions if v]))


async def v2_model_ready(request: Request) -> HttpResponse:
    try:
        model = _model(request)
    except ServingError as error:
        return refusal(error, v2=True)
    return json_answer({"name": model.name, "ready": True})


async def v2_stats(request: Request) -> HttpResponse:
    try:
        model = _model(request)
    except ServingError as error:
        return refusal(error, v2=True)
    batches = model.batcher.batches
    return json_answer({"model_stats": [{
        "name": model.name,
        "version": model.version or "",
        "inference_count": sum(size * count for size, count in batches.items()),
        "execution_count": sum(batches.values()),
        "batch_stats": [{"batch_size": size, "compute_infer": {"count": count}} for size, count in sorted(batches.items())],
    }]})


async def live(request: Request) -> HttpResponse:
    return json_answer({"live": True})


async def ready(request: Request) -> HttpResponse:
    return json_answer({"ready": True})  # a process answers only once its models are loaded


async def metrics(request: Request) -> HttpResponse:
    return HttpResponse(scrape(), media_type=CONTENT_TYPE_LATEST)


async def ping(request: Request) -> HttpResponse:
    return json_answer({"status": "Healthy"})


def _both(path: str, endpoint, methods: list[str]) -> list[Route]:
    """``path`` under /v2/models/{model} and under /v2/models/{model}/versions/{version}."""
    return [
        Route(f"/v2/models/{{model}}{path}", endpoint, methods=methods),
        Route(f"/v2/models/{{model}}/versions/{{version}}{path}", endpoint, methods=methods),
    ]


ROUTES = [
    Route("/predictions/{model}", predictions, methods=["POST"]),
    Route("/predictions/{model}/{version}", predictions, methods=["POST"]),
    *_both("/infer", v2_infer, ["POST"]),
    *_both("/ready", v2_model_ready, ["GET"]),
    *_both("/stats", v2_stats, ["GET"]),
    *_both("", v2_metadata, ["GET"]),
    Route("/v2/health/live", live, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    Route("/ping", ping, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
