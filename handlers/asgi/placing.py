"""Archives of the model store placed for the ASGI engine: each in a folder of the engine's own
under its state folder (``<state>/models/<stem>-<hex>/``), which every server process loads, so
that all of them share one working copy of its tables (named by that folder) and one delta log.

A ``.mar`` is unpacked there (as TorchServe's frontend unpacks it); an archive folder is linked
file by file, so that it stays as built: the freshness files (the log pointer, the calls folder)
go into the engine's folder, never the archive's. The model's delta log is where the TorchServe
plugin keeps it (``archive_tools/plugin/java/.../Freshness.java``):
``<store>/deltas/<model>/<first 16 hex of the tables' fingerprint>/log``.

    folder = place(Path("model_store"), "tiny.mar", Path("/tmp/engine-state"))
"""

from __future__ import annotations

import re
import secrets
import shutil
import zipfile
from pathlib import Path

import orjson

from handlers.runtime.archive_files import LOG_POINTER, MANIFEST, TABLES
from handlers.runtime.errors import BadRequest, ModelNotFoundException
from handlers.runtime.freshness.protocol import write_whole

FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MODELS_FOLDER = "models"


def store_file(store: Path, name: str, field: str) -> Path:
    """``name``, a file or folder directly inside ``store``: paths are refused (400), a missing one is 404."""
    if not FILE_NAME.fullmatch(name):
        raise BadRequest(field, f"must name a file directly inside {store}, got {name!r}; paths are refused")
    path = Path(store) / name
    if not path.exists():
        raise ModelNotFoundException(f"{field}: no {name!r} in {store}")
    return path


def place(store: Path, name: str, state_dir: Path) -> Path:
    """The archive ``name`` of ``store`` in a new folder of the engine's, its delta log named."""
    source = store_file(store, name, "url")
    target = Path(state_dir) / MODELS_FOLDER / f"{source.name.split('.')[0]}-{secrets.token_hex(4)}"
    staged = target.with_name(target.name + ".partial")
    staged.mkdir(parents=True)
    try:
        if source.is_dir():
            for entry in source.iterdir():
                (staged / entry.name).symlink_to(entry.resolve())
        elif zipfile.is_zipfile(source):
            with zipfile.ZipFile(source) as archive:
                archive.extractall(staged)
        else:
            raise BadRequest("url", f"{name}: neither a .mar nor an archive folder")
        if not (staged / MANIFEST).is_file():
            raise BadRequest("url", f"{name}: holds no {MANIFEST}")
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    staged.rename(target)
    log = log_folder(store, target)
    if log is not None:
        write_whole(target / LOG_POINTER, orjson.dumps({"log": str(log)}))
    return target


def model_name(folder: Path) -> str:
    return str(orjson.loads((Path(folder) / MANIFEST).read_bytes())["model"]["modelName"])


def log_folder(store: Path, folder: Path) -> Path | None:
    """The model's delta log (made when the first delta is published); None without ``tables.json``."""
    try:
        fingerprint = orjson.loads((Path(folder) / TABLES).read_bytes())["fingerprint"]
    except (FileNotFoundError, orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return Path(store).resolve() / "deltas" / model_name(folder) / str(fingerprint)[:16] / "log"
