"""Built archives, read back: a ``.mar`` (a zip) or an unzipped archive folder, loaded in this
process exactly as a TorchServe worker loads it."""

from __future__ import annotations

import zipfile
from pathlib import Path

import yaml

from handlers.loading import load_service
from handlers.runtime.options import HandlerOptions
from handlers.runtime.service import ScoringService


def archive_folder(archive: Path, unpack_to: Path) -> Path:
    """The archive's folder: the archive itself if unzipped, else the ``.mar`` unzipped into
    ``unpack_to``."""
    archive = Path(archive)
    if archive.is_dir():
        return archive
    with zipfile.ZipFile(archive) as z:
        z.extractall(unpack_to)
    return Path(unpack_to)


def handler_options(folder: Path) -> HandlerOptions:
    """What the archive's ``model-config.yaml`` tells the worker to load."""
    config = yaml.safe_load((folder / "model-config.yaml").read_text()) or {}
    return HandlerOptions.from_mapping(config.get("handler"))


def load_archive(archive: Path, unpack_to: Path) -> ScoringService:
    """The archive's model behind a scoring service, as a worker loads it."""
    folder = archive_folder(archive, unpack_to)
    return load_service(folder, handler_options(folder))
