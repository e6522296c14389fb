"""A built archive, opened: a ``.mar`` read through (each file taken out when first asked for, not
its gigabytes of tables), an unzipped archive folder, or a worker's model folder.

    with Archive.open(Path("model_store/tiny.mar")) as archive:
        archive.options.artifact     # Artifact.AOTI: what model-config.yaml's handler section says
        archive.inputs               # InputSchema, from inputs.json
        archive.layout               # TablesLayout from tables.json, or None: it holds no tables
        archive.file(SPEC)           # a file's path (taken out of the .mar now if need be)
        archive.unpacked()           # the whole folder, for loading its model as a worker does

    archive = Archive(model_dir)     # a worker's folder: nothing to close

File names are in ``handlers.runtime.archive_files``. The spec is parsed by ``handlers.modeling``
(``registry.archive_spec(archive)``): the runtime serves graphs without the code that built them.
"""

from __future__ import annotations

import functools
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

from handlers.runtime.archive_files import INPUTS, MODEL_CONFIG, TABLES, WEIGHTS, aoti_weights_file
from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InputError
from handlers.runtime.freshness.layout import TablesLayout
from handlers.runtime.inputs import InputSchema
from handlers.runtime.options import HandlerOptions


class Archive:
    """``path``: a ``.mar`` or an archive folder. A ``.mar``'s files go to a temporary folder,
    removed by ``close`` (or the ``with`` block)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._zip: zipfile.ZipFile | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        if self.path.is_dir():
            self.folder = self.path
        elif zipfile.is_zipfile(self.path):
            self._zip = zipfile.ZipFile(self.path)
            self._tmp = tempfile.TemporaryDirectory(prefix=f"{self.path.stem}-archive-")
            self.folder = Path(self._tmp.name)
        elif self.path.exists():
            raise InputError(f"{self.path}: neither a .mar nor an archive folder")
        else:
            raise FileNotFoundError(f"{self.path}: no such archive")

    @classmethod
    def open(cls, path: str | Path) -> "Archive":
        return cls(path)

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
            self._zip = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- its files ---------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        if self._zip is not None:
            return name in self._zip.namelist()
        return (self.folder / name).exists()

    def file(self, name: str) -> Path:
        """The path of the archive's file ``name``; a missing one is named with the archive."""
        path = self.folder / name
        if self._zip is not None and not path.exists() and self.has(name):
            self._zip.extract(name, self.folder)
        if not path.exists():
            raise FileNotFoundError(f"{self.path}: holds no {name}")
        return path

    def unpacked(self) -> Path:
        """The folder with every file of the archive in it."""
        if self._zip is not None:
            self._zip.extractall(self.folder, [n for n in self._zip.namelist() if not (self.folder / n).exists()])
        return self.folder

    # -- what it says ------------------------------------------------------------------------------

    @functools.cached_property
    def model_config(self) -> dict[str, Any]:
        """``model-config.yaml``: TorchServe's settings and the handler, guard, freshness sections."""
        try:
            return yaml.safe_load(self.file(MODEL_CONFIG).read_text()) or {}
        except yaml.YAMLError as e:
            raise InputError(f"{self.path}: {MODEL_CONFIG} is not valid YAML: {e}") from None

    @functools.cached_property
    def options(self) -> HandlerOptions:
        """What the worker loads: the ``handler`` section."""
        return HandlerOptions.from_mapping(self.model_config.get("handler"))

    @functools.cached_property
    def inputs(self) -> InputSchema:
        return InputSchema.from_file(self.file(INPUTS))

    @functools.cached_property
    def layout(self) -> TablesLayout | None:
        """Where the tables' rows lie; None for an archive that holds no tables."""
        return TablesLayout.load(self.file(TABLES).parent) if self.has(TABLES) else None

    def tables_file(self) -> Path:
        """The file that holds the tables (taken out of a ``.mar``); raises ``InputError`` naming
        why where deltas cannot reach them."""
        name, why = tables_file_name(self.options)
        if name is None:
            raise InputError(f"{self.path}: cannot take deltas: {why}")
        return self.file(name)


def tables_file_name(options: HandlerOptions) -> tuple[str | None, str | None]:
    """(the name of the archive file that holds the tables, None), or (None, why deltas cannot
    reach them)."""
    artifact, part = options.artifact, "model"
    if artifact == Artifact.REMOTE:
        return None, "a dense host of a distributed layout holds no tables: its embedding shards do"
    if artifact == Artifact.SPLIT:
        artifact, part = options.split.sparse, "sparse"  # type: ignore[union-attr]
    if artifact == Artifact.EXPORTED:
        return None, (
            "an exported program reads its tables into each worker's memory at load; build the "
            "archive as aoti or eager (or a split with aoti or eager lookups) to publish deltas"
        )
    if artifact in (Artifact.EAGER, Artifact.LOOKUPS):
        return WEIGHTS, None
    return aoti_weights_file(Path(artifact.file_name(part))).name, None
