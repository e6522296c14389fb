"""The Open Inference Protocol's gRPC service, ``inference.GRPCInferenceService``
(``handlers/runtime/wire/open_inference.proto``), in each server process beside its HTTP routes: a
grpc.aio server on the process's event loop, started once its models are loaded and stopped before
they are (``app.py``). Every process listens on the same port: gRPC sets SO_REUSEPORT on Linux, so
the kernel spreads connections over the processes (a connection, with all its calls, stays with
one). ``settings.check_port_free`` runs before the processes start: a second server on that port would
otherwise share it silently.

``ModelInfer`` is the REST route's request (``wire.v2_grpc``) handed to the model's batcher:
batched with the REST requests, scored alike, refused with the same messages, alone (no class
name). Every call needs ``authorization: Bearer KEY`` metadata, the inference key, health and
metadata included. Statuses, by the REST status of the same refusal:

    400, 415  INVALID_ARGUMENT    bad input (the message names the field), or the model refused it
    404       NOT_FOUND           no such model or version
    413       RESOURCE_EXHAUSTED  over the model's limits.max_request_bytes; gRPC itself refuses a
                                  message over the largest limit of the models loaded at start
    503       UNAVAILABLE         shed by admission (the queue is over its wait target), or an
                                  embedding shard did not answer: retry with backoff. The code gRPC
                                  clients and proxies retry, kept apart from RESOURCE_EXHAUSTED,
                                  whose fix (a smaller request) is another
    -         UNAUTHENTICATED     a missing or wrong key
    500       INTERNAL            the server's fault (its log has the traceback)

    server = await start(models, key, "127.0.0.1", 8081)
    ...
    await server.stop(GRACE_S)
"""

from __future__ import annotations

import hmac
import importlib.metadata
import logging
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import Message

from handlers.asgi.metadata import PLATFORM, model_metadata
from handlers.asgi.registry import ModelRegistry, ServedModel
from handlers.asgi.settings import listen_address
from handlers.runtime.errors import InputError, InvalidKeyException, ServingError
from handlers.runtime.inputs import Limits
from handlers.runtime.wire.transport import too_large
from handlers.runtime.wire.v2_grpc import SERVICE, error_message, infer_arrival, infer_response, messages

logger = logging.getLogger(__name__)

STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
}
GRACE_S = 10.0  # calls under way when the process stops get this long to finish

Call = Callable[[Any], Awaitable[Message]]


class _Refused(ServingError):
    """The runtime's refusal of one request: its v2 error answer's status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class InferenceServicer:
    """The service's calls over one process's models (``models`` changes as models are registered)."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models
        self.proto = messages()

    def handler(self) -> grpc.GenericRpcHandler:
        calls: dict[str, Call] = {
            "ServerLive": self.server_live, "ServerReady": self.server_ready, "ModelReady": self.model_ready,
            "ServerMetadata": self.server_metadata, "ModelMetadata": self.model_metadata,
            "ModelInfer": self.model_infer,
        }
        methods = {}
        for method in self.proto.service(SERVICE).methods:
            methods[method.name] = grpc.unary_unary_rpc_method_handler(
                _answering(calls[method.name]),
                request_deserializer=self.proto.message(method.input_type.full_name).FromString,
                response_serializer=self.proto.message(method.output_type.full_name).SerializeToString,
            )
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    async def server_live(self, request: Any) -> Message:
        return self._reply("ServerLiveResponse", live=True)

    async def server_ready(self, request: Any) -> Message:
        return self._reply("ServerReadyResponse", ready=True)  # the server starts once its models are loaded

    async def model_ready(self, request: Any) -> Message:
        self._model(request.name, request.version)
        return self._reply("ModelReadyResponse", ready=True)

    async def server_metadata(self, request: Any) -> Message:
        return self._reply("ServerMetadataResponse", name=PLATFORM, version=_version(), extensions=[])

    async def model_metadata(self, request: Any) -> Message:
        model = self._model(request.name, request.version)
        versions = [model.version] if request.version else self.models.versions(model.name)
        described = model_metadata(model.service.schema, model.name, [v for v in versions if v])
        return self._reply("ModelMetadataResponse", **described)

    async def model_infer(self, request: Any) -> Message:
        model = self._model(request.model_name, request.model_version)
        limit = model.service.schema.limits.max_request_bytes
        size = request.ByteSize()
        if size > limit:
            raise too_large(size, limit)
        response = await model.batcher.submit(infer_arrival(request))
        if response.status != 200:
            raise _Refused(response.status, error_message(response))
        return infer_response(response)

    def _model(self, name: str, version: str) -> ServedModel:
        return self.models.get(name, version or None)

    def _reply(self, message: str, /, **fields: Any) -> Message:
        return self.proto.message(f"inference.{message}")(**fields)


def _answering(call: Call) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]:
    """``call`` as a handler: its answer, or its error as the status of ``STATUS``."""

    async def answer(request: Any, context: grpc.aio.ServicerContext) -> Message:
        try:
            return await call(request)
        except ServingError as error:
            code, message = STATUS.get(error.status, grpc.StatusCode.INTERNAL), error.message
        except Exception:
            logger.exception("gRPC %s failed", call.__name__)
            code, message = grpc.StatusCode.INTERNAL, "internal error: the server's log has its traceback"
        await context.abort(code, message)

    return answer


class _KeyCheck(grpc.aio.ServerInterceptor):
    """Calls without ``authorization: Bearer KEY`` are refused before their handler runs."""

    def __init__(self, key: str) -> None:
        self.expected = f"Bearer {key}".encode()
        self.refused = grpc.unary_unary_rpc_method_handler(_unauthenticated)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        for name, value in details.invocation_metadata or ():
            if name == "authorization":
                sent = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(sent, self.expected):
                    return await continuation(details)
                break
        return self.refused


async def _unauthenticated(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, InvalidKeyException().message)


async def start(models: ModelRegistry, key: str, host: str, port: int) -> grpc.aio.Server:
    """The service on ``host:port``, started; messages over the largest ``max_request_bytes`` of
    ``models`` (at least the default) are refused by gRPC (a model registered later with a larger
    limit takes no more)."""
    largest = max([Limits.max_request_bytes, *(m.service.schema.limits.max_request_bytes for m in models.models)])
    server = grpc.aio.server(
        interceptors=[_KeyCheck(key)],
        options=[("grpc.max_receive_message_length", largest), ("grpc.so_reuseport", 1)],
    )
    server.add_generic_rpc_handlers((InferenceServicer(models).handler(),))
    try:
        server.add_insecure_port(listen_address(host, port))
    except RuntimeError as error:
        raise InputError(f"--grpc-port: cannot listen on {listen_address(host, port)}: {error}") from None
    await server.start()
    return server


def _version() -> str:
    try:
        return importlib.metadata.version("torchrec-serve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return ""
