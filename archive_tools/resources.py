"""Where the project's shipped files are: ``config/`` of a checkout, or the copy that installs with
the package (``archive_tools.config``), so that the commands work outside a checkout too."""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def config_dir() -> Path:
    """The folder holding ``config.properties`` and ``models/``."""
    checkout = Path(__file__).resolve().parent.parent / "config"
    if (checkout / "config.properties").is_file():
        return checkout
    installed = importlib.resources.files("archive_tools.config").joinpath("config.properties")
    return Path(str(installed)).parent


def models_dir() -> Path:
    return config_dir() / "models"


def spec_path(name_or_path: str | Path) -> Path:
    """A spec file: the path itself, or the shipped spec of that name (``criteo`` ->
    ``config/models/criteo.yaml``)."""
    path = Path(name_or_path)
    if path.exists() or path.suffix:
        return path
    shipped = models_dir() / f"{name_or_path}.yaml"
    if shipped.exists():
        return shipped
    names = ", ".join(sorted(p.stem for p in models_dir().glob("*.yaml")))
    raise FileNotFoundError(f"{name_or_path}: no such spec file, nor a shipped spec ({names})")
