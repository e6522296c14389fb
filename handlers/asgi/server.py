"""Running the ASGI engine: the archives of a model store unpacked once (a ``.mar``, as TorchServe's
frontend unpacks it; a folder is served where it is), then uvicorn with ``workers`` processes on
one port, each loading every model (``app.py``), until SIGINT or SIGTERM; their metrics counted
in a directory of the run's own (``metrics.use_directory``), removed when it ends.

    with ServedArchives(Path("model_store"), ["tiny.mar"]) as folders:
        run(EngineSettings(folders, Path("keys.json")), host="127.0.0.1", port=8080, workers=4)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import uvicorn

from handlers.asgi.app import ENGINE_ENV, EngineSettings
from handlers.asgi.metrics import use_directory
from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import MANIFEST


class ServedArchives:
    """``names`` in ``store`` (none: every ``.mar`` and archive folder there), opened for the
    server's life: ``__enter__`` gives each one's unpacked folder."""

    def __init__(self, store: Path, names: Sequence[str]) -> None:
        self.store = Path(store)
        self.names = list(names) or sorted(
            p.name for p in self.store.iterdir() if p.suffix == ".mar" or (p / MANIFEST).is_file()
        )
        self._open: list[Archive] = []

    def __enter__(self) -> tuple[Path, ...]:
        try:
            for name in self.names:
                self._open.append(Archive.open(self.store / name))
            return tuple(archive.unpacked() for archive in self._open)
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for archive in self._open:
            archive.close()
        self._open.clear()


def run(settings: EngineSettings, host: str, port: int, workers: int) -> None:
    """Serves until a signal stops every process (uvicorn's own handling of SIGINT and SIGTERM)."""
    os.environ[ENGINE_ENV] = settings.to_env()  # read by each worker process
    counts = Path(tempfile.mkdtemp(prefix="torchrec-serve-metrics-"))  # empty: this run's counts only
    use_directory(counts)  # this process's and its workers'
    try:
        _serve(host, port, workers)
    finally:
        shutil.rmtree(counts, ignore_errors=True)


def _serve(host: str, port: int, workers: int) -> None:
    uvicorn.run(
        "handlers.asgi.app:app_from_environment",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        lifespan="on",
        access_log=False,
        log_level="info",
        timeout_graceful_shutdown=30,
    )
