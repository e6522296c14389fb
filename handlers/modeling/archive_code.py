"""The architecture an archive was built with: ``architecture.json`` records its name, the
contract version it was built against and, for a user's architecture in an archive that runs
TorchRec modules (``eager``, eager lookups), the package the archive carries in ``code/``.

    record = ArchitectureRecord.of(spec)       # at build
    record.stage(staging, carry=True)          # architecture.json, and code/<package>/
    use_archive_code(model_dir)                # in the worker, before the spec is parsed

A graph archive carries no code: its worker never imports the architecture.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import sys
from pathlib import Path

import orjson

from handlers.modeling.architecture import CONTRACT_VERSION
from handlers.modeling.errors import SpecError
from handlers.modeling.registry import registered, remember
from handlers.modeling.spec import ModelSpec
from handlers.runtime.archive_files import ARCHITECTURE, CODE

_SHIPPED_PACKAGE = "handlers"


@dataclasses.dataclass(frozen=True)
class ArchitectureRecord:
    """``architecture``: the spec's value; ``path``: where it is defined (``module:attribute``),
    so that a worker finds it by that name without the entry point the build had; ``package``:
    the top-level package carried in ``code/`` (None: shipped, or a graph archive)."""

    architecture: str
    contract_version: int
    path: str
    package: str | None = None

    @classmethod
    def of(cls, spec: ModelSpec) -> "ArchitectureRecord":
        return cls(spec.architecture, CONTRACT_VERSION, registered().get(spec.architecture, spec.architecture))

    @property
    def module(self) -> str:
        return self.path.partition(":")[0]

    @property
    def is_users(self) -> bool:
        return self.module.split(".")[0] != _SHIPPED_PACKAGE

    def stage(self, staging: Path, carry: bool) -> str | None:
        """Writes ``architecture.json`` and, with ``carry``, copies a user's package into
        ``code/``; returns a line saying what the archive carries (None for a shipped one)."""
        record = self
        line = None
        if self.is_users:
            top = self.module.split(".")[0]
            if carry:
                source = _package_source(top)
                if source.is_dir():
                    shutil.copytree(source, staging / CODE / top, ignore=shutil.ignore_patterns("__pycache__"))
                else:  # a module of one file
                    (staging / CODE).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, staging / CODE / source.name)
                record = dataclasses.replace(self, package=top)
                line = f"architecture {self.architecture}: the archive carries {top} ({source}) for its workers"
            else:
                line = f"architecture {self.architecture}: a graph archive; its workers do not import {top}"
        (staging / ARCHITECTURE).write_bytes(orjson.dumps(dataclasses.asdict(record), option=orjson.OPT_INDENT_2))
        return line


def use_archive_code(model_dir: Path) -> None:
    """Checks the archive's contract version, puts its carried code first on ``sys.path`` and
    names its architecture where the build found it (installed entry points or not)."""
    path = model_dir / ARCHITECTURE
    if not path.exists():
        return
    record = ArchitectureRecord(**orjson.loads(path.read_bytes()))
    if record.contract_version != CONTRACT_VERSION:
        raise SpecError(
            f"{path}: built against architecture contract {record.contract_version}, this worker "
            f"implements {CONTRACT_VERSION}; rebuild the archive"
        )
    code = str(model_dir / CODE)
    if record.package is not None and code not in sys.path:
        sys.path.insert(0, code)
    remember(record.architecture, record.path)


def _package_source(top: str) -> Path:
    found = importlib.util.find_spec(top)
    if found is None or (found.origin is None and not found.submodule_search_locations):
        raise SpecError(f"architecture: cannot find the files of package {top}")
    if found.submodule_search_locations:
        return Path(list(found.submodule_search_locations)[0])
    return Path(found.origin)  # type: ignore[arg-type]
