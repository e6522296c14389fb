"""The one place the ASGI engine turns what it holds into HTTP answers: the runtime's ``Response``
as it is (status, body, content type and headers decided by the runtime's encoders, as the
TorchServe adapter passes them on), and the errors the server raises before a request reaches the
model (``handlers.runtime.errors`` types: their ``status``), in the route's protocol:

* ``/predictions``: ``{"code", "type", "message"}``, TorchServe's and the plugin's shape;
* KServe v2 routes: ``{"error": "..."}``, the protocol's.

A 503 carries ``Retry-After: 1``, as the plugin's does.
"""

from __future__ import annotations

import orjson
from starlette.responses import Response as HttpResponse

from handlers.runtime.errors import ServingError
from handlers.runtime.wire.messages import JSON, Response

RETRY_AFTER_S = "1"


def answer(response: Response) -> HttpResponse:
    """The runtime's answer to one request, unchanged."""
    return HttpResponse(response.body, response.status, dict(response.headers), media_type=response.content_type)


def refusal(error: ServingError, v2: bool) -> HttpResponse:
    body = {"error": error.message} if v2 else error.to_body()
    headers = {"Retry-After": RETRY_AFTER_S} if error.status == 503 else {}
    return HttpResponse(orjson.dumps(body), error.status, headers, media_type=JSON)


def json_answer(body: object, status: int = 200) -> HttpResponse:
    """A route's own JSON (health, metadata, statistics)."""
    return HttpResponse(orjson.dumps(body), status, media_type=JSON)
