"""``torchrec-serve serve --engine asgi``: the archives of a model store on the project's own ASGI
server (``handlers.asgi``), one port for every HTTP route and one for the Open Inference
Protocol's gRPC service (0: none), ``--workers`` processes.

    torchrec-serve serve --engine asgi tiny.mar --workers 4 --port 8080 --grpc-port 8081 --key-file keys.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from archive_tools.local_server import free_port
from handlers.asgi.key_file import KeyFile
from handlers.asgi.server import APP, ServedArchives, run
from handlers.asgi.settings import EngineSettings
from handlers.runtime.errors import InputError

DEFAULT_PORT = 8080  # KServe's: where it sends a predictor's HTTP requests
DEFAULT_GRPC_PORT = 8081  # and where its runtimes take gRPC


def serve_asgi(args: argparse.Namespace, app: str = APP) -> int:
    """The archives on the project's own ASGI server (uvicorn), until Ctrl-C or SIGTERM; ``app``:
    each process's application factory (``handlers.asgi.server.run``)."""
    if args.config is not None:
        raise InputError(
            "--config: TorchServe's configuration; the asgi engine takes --host, --port, --grpc-port, --workers, "
            "--key-file"
        )
    given = [f"--{n.replace('_', '-')}" for n in ("port", "grpc_port") if getattr(args, n) is not None]
    if args.free_ports and given:
        raise InputError(f"--free-ports: listens on free ports, not {' or '.join(given)}; give one of them")
    workers = args.workers if args.workers is not None else os.cpu_count() or 1
    if workers < 1:
        raise InputError(f"--workers: must be 1 or more, got {workers}")
    port = free_port() if args.free_ports else (args.port or DEFAULT_PORT)
    grpc_port = free_port() if args.free_ports else (DEFAULT_GRPC_PORT if args.grpc_port is None else args.grpc_port)
    if not 0 <= grpc_port <= 65535:
        raise InputError(f"--grpc-port: must be a port, 1 to 65535, or 0 for no gRPC; got {grpc_port}")
    if grpc_port == port:
        raise InputError(f"--grpc-port: {grpc_port} is the HTTP port (--port); give another")
    key_file = (args.key_file or Path(tempfile.mkdtemp(prefix="torchrec-serve-asgi-")) / "keys.json").resolve()
    KeyFile(key_file).key()  # written now if it does not exist
    host = args.host or "127.0.0.1"
    store = args.model_store.resolve()
    with ServedArchives(store, args.archives) as state_dir:
        grpc = f", gRPC (inference.GRPCInferenceService) on {host}:{grpc_port}" if grpc_port else ", no gRPC"
        print(f"ASGI engine: every HTTP route on http://{host}:{port}{grpc}, {workers} processes")
        print(f"keys (Authorization: Bearer <key>; the management key on /models and /freshness): {key_file}", flush=True)
        settings = EngineSettings((), key_file, store, state_dir, grpc_host=host, grpc_port=grpc_port)
        run(settings, host=host, port=port, workers=workers, app=app)
    return 0
