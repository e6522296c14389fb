"""Running the ASGI engine: the archives of a model store placed once in the engine's state folder
(``placing.py``: a ``.mar`` unpacked, as TorchServe's frontend unpacks it; a folder linked) and
named as the wanted state (``engine_state.py``), then uvicorn with ``workers`` processes on one
port, each loading every model wanted (``app.py``) and serving gRPC on ``settings.grpc_port``
where one is given (checked free first: the processes share it, ``grpc_v2.py``), until SIGINT or
SIGTERM. uvicorn's supervisor starts a new process in place of one that dies. Their metrics are
counted in a directory of the run's own (``metrics_dir.use_directory``), removed when it ends.

    with ServedArchives(Path("model_store"), ["tiny.mar"]) as state_dir:
        run(EngineSettings((), Path("keys.json"), Path("model_store"), state_dir), host="127.0.0.1", port=8080, workers=4)
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Sequence

import uvicorn

from handlers.asgi.connections import CountedHttpTools
from handlers.asgi.engine_state import EngineState, WantedModel
from handlers.asgi.metrics_dir import use_directory
from handlers.asgi.placing import place
from handlers.asgi.settings import ENGINE_ENV, EngineSettings, check_port_free
from handlers.runtime.archive_files import MANIFEST

APP = "handlers.asgi.factory:app_from_environment"  # uvicorn's factory of each process's application


class ServedArchives:
    """``names`` in ``store`` (none: every ``.mar`` and archive folder there), placed in a new state
    folder for the server's life: ``__enter__`` gives the folder, removed by ``__exit__``."""

    def __init__(self, store: Path, names: Sequence[str]) -> None:
        self.store = Path(store)
        self.names = list(names) or sorted(
            p.name for p in self.store.iterdir() if p.suffix == ".mar" or (p / MANIFEST).is_file()
        )
        self.folder: Path | None = None

    def __enter__(self) -> Path:
        self.folder = Path(tempfile.mkdtemp(prefix="torchrec-serve-asgi-state-"))
        try:
            with EngineState(self.folder).changing() as wanted:
                wanted.models = [WantedModel(name, str(place(self.store, name, self.folder))) for name in self.names]
            return self.folder
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def run(settings: EngineSettings, host: str, port: int, workers: int, app: str = APP) -> None:
    """Serves until a signal stops every process (uvicorn's own handling of SIGINT and SIGTERM);
    ``app``: the factory each process builds its application with, as uvicorn imports it (a
    benchmark wraps the engine's own: ``benchmarks.asgi_floor``)."""
    if settings.grpc_port:
        check_port_free(settings.grpc_host, settings.grpc_port)
    os.environ[ENGINE_ENV] = settings.to_env()  # read by each worker process
    # Once shut down by SIGTERM, uvicorn raises it again for the process to end by it: by the
    # signal's default action that end came before the folders of the run were removed.
    signal.signal(signal.SIGTERM, _exit_by_signal)
    counts = Path(tempfile.mkdtemp(prefix="torchrec-serve-metrics-"))  # empty: this run's counts only
    use_directory(counts)  # this process's and its workers'
    try:
        _serve(app, host, port, workers)
    finally:
        shutil.rmtree(counts, ignore_errors=True)


def _exit_by_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the code a shell gives a process the signal ended


def _serve(app: str, host: str, port: int, workers: int) -> None:
    uvicorn.run(
        app,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        lifespan="on",
        access_log=False,
        log_level="info",
        timeout_graceful_shutdown=30,
        # C parsing (1.6-1.8x h11's one-item items/s at c=32 here; h11: uvicorn's pure-Python
        # default), its connections counted for the batchers (connections.py)
        http=CountedHttpTools,
        loop="uvloop",  # and 5-15% more
    )
