"""The asgi engine's own no-op floor, for the engines benchmark (``benchmarks/engines.py``):

    python -m benchmarks.asgi_floor criteo.mar --model-store STORE --port 8080 --workers 1 --key-file keys.json

``torchrec-serve serve --engine asgi`` as it is (the same arguments, uvicorn, the routes, the key
check, the body read up to the model's limit, each model's batcher with the archive's batch size
and delay, the hop to the forward thread and back), with one thing replaced once the models are
loaded: each batch is answered as ``benchmarks/noop_handler.py`` answers TorchServe's, the same
small body for every request, nothing decoded, no forward. TorchServe's floor is that handler
behind TorchServe; this is the asgi engine's.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from archive_tools.asgi_engine import serve_asgi
from archive_tools.cli_args import serve_args
from benchmarks.noop_handler import ANSWER
from handlers.asgi.factory import app_from_environment as engine_app
from handlers.asgi.auth import Receive, Scope, Send
from handlers.runtime.wire.messages import Response

MODULE = "benchmarks.asgi_floor"  # run as ``python -m MODULE``, with ``torchrec-serve serve``'s arguments
APP = f"{MODULE}:app_from_environment"
_UNSCORED = Response(200, ANSWER)


def app_from_environment() -> "NoScoring":
    """uvicorn's factory, in each server process: the engine's application, its scoring replaced."""
    return NoScoring(engine_app())


class NoScoring:
    """ASGI middleware: once the application has started (every model loaded, its batcher
    running), each model's batches are answered without scoring."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def sending(message: dict) -> None:
            if message["type"] == "lifespan.startup.complete":
                for model in scope["app"].state.models.models:  # Starlette puts itself in the scope
                    model.batcher.handle = _unscored
            await send(message)

        await self.app(scope, receive, sending)


def _unscored(arrivals: Sequence[object]) -> list[Response]:
    return [_UNSCORED] * len(arrivals)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.asgi_floor", description="the asgi engine, each batch answered without scoring (the engines benchmark's floor)")
    serve_args(parser)
    return serve_asgi(parser.parse_args(argv), app=APP)


if __name__ == "__main__":
    sys.exit(main())
