"""``torchrec-serve serve --engine asgi``: the archives of a model store on the project's own ASGI
server (``handlers.asgi``), one port for every route, ``--workers`` processes.

    torchrec-serve serve --engine asgi tiny.mar --workers 4 --port 8080 --key-file keys.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from archive_tools.local_server import free_port
from handlers.asgi.app import EngineSettings
from handlers.asgi.auth import KeyFile
from handlers.asgi.server import APP, ServedArchives, run
from handlers.runtime.errors import InputError


def serve_asgi(args: argparse.Namespace, app: str = APP) -> int:
    """The archives on the project's own ASGI server (uvicorn), until Ctrl-C or SIGTERM; ``app``:
    each process's application factory (``handlers.asgi.server.run``)."""
    if args.config is not None:
        raise InputError(
            "--config: TorchServe's configuration; the asgi engine takes --host, --port, --workers, --key-file"
        )
    if args.free_ports and args.port is not None:
        raise InputError("--free-ports: listens on a free port, not --port; give one of them")
    workers = args.workers if args.workers is not None else os.cpu_count() or 1
    if workers < 1:
        raise InputError(f"--workers: must be 1 or more, got {workers}")
    port = free_port() if args.free_ports else (args.port or 8080)
    key_file = (args.key_file or Path(tempfile.mkdtemp(prefix="torchrec-serve-asgi-")) / "keys.json").resolve()
    KeyFile(key_file).key()  # written now if it does not exist
    host = args.host or "127.0.0.1"
    store = args.model_store.resolve()
    with ServedArchives(store, args.archives) as state_dir:
        print(f"ASGI engine: every route on http://{host}:{port}, {workers} processes")
        print(f"keys (Authorization: Bearer <key>; the management key on /models and /freshness): {key_file}", flush=True)
        run(EngineSettings((), key_file, store, state_dir), host=host, port=port, workers=workers, app=app)
    return 0
