"""The architectures a spec can name, and everything that needs one: spec parsing, the input
schema, synthetic requests, the JSON Schema of spec files.

A spec's ``architecture`` is a name registered in the ``torchrec_serve.architectures`` entry point
group (the shipped ``dlrm``, ``dlrm_dcn`` and ``context_ranker`` are, in ``pyproject.toml``; a
user's package registers its own the same way) or an import path ``package.module:attribute``.
Either resolves to an ``Architecture`` (``handlers.modeling.architecture``, the contract), checked
when it is first resolved: an unknown name, an import error, a wrong type, a missing method or
another contract version is a ``SpecError`` naming it.

    spec = load_spec("config/models/criteo.yaml")        # the architecture's own spec type
    architecture_of(spec).build(spec, tables, device)
    input_schema(spec)                                   # what the runtime decodes and batches
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Mapping, Union

import yaml
from pydantic import TypeAdapter, ValidationError
import torch
from torch import nn

from handlers.modeling.architecture import CONTRACT_VERSION, Architecture
from handlers.modeling.errors import SpecError
from handlers.modeling.spec import ModelSpec
from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import PRUNING, SPEC
from handlers.runtime.inputs import InputSchema

DEFAULT_ARCHITECTURE = "dlrm"
ENTRY_POINT_GROUP = "torchrec_serve.architectures"


_REMEMBERED: dict[str, str] = {}  # names an archive's architecture.json gave (archive_code)


def registered() -> dict[str, str]:
    """Registered architecture name -> its import path (``module:attribute``): the entry points,
    and the names archives loaded in this process recorded."""
    found = {e.name: e.value for e in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)}
    return {**found, **_REMEMBERED}


def remember(name: str, path: str) -> None:
    """``name`` resolves to ``path`` in this process (an archive says where its architecture is)."""
    if _REMEMBERED.get(name) != path:
        _REMEMBERED[name] = path
        resolve.cache_clear()


def shipped_architectures() -> dict[str, Architecture]:
    """The architectures this project ships (``handlers.modeling.architectures``), by name."""
    package = "handlers.modeling.architectures."
    return {name: resolve(name) for name, path in registered().items() if path.startswith(package)}


def architecture_of(spec: ModelSpec) -> Architecture:
    return resolve(spec.architecture)


@functools.cache
def resolve(name: str) -> Architecture:
    """The architecture a spec's ``architecture`` value names, checked against the contract."""
    path = registered().get(name, name)
    if ":" not in path:
        known = ", ".join(registered()) or "none: install torchrec-serve (pip install -e .)"
        raise SpecError(
            f"architecture: {name!r} is neither a registered architecture ({known}) nor an import "
            "path package.module:attribute"
        )
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module failing to import is the user's error, named
        raise SpecError(f"architecture: {name}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    found = getattr(module, attribute, None)
    if found is None:
        raise SpecError(f"architecture: {name}: {module_name} has no attribute {attribute!r}")
    if isinstance(found, type) and issubclass(found, Architecture):
        try:
            found = found()
        except TypeError as e:  # abstract methods left out
            raise SpecError(f"architecture: {name}: {e}") from None
    if not isinstance(found, Architecture):
        raise SpecError(
            f"architecture: {name}: {path} is a {type(found).__name__}, not a "
            "handlers.modeling.architecture.Architecture (instance or subclass)"
        )
    for needed in ("name", "spec_type"):
        if not hasattr(found, needed):
            raise SpecError(f"architecture: {name}: {type(found).__name__} does not set {needed}")
    if found.contract_version != CONTRACT_VERSION:
        raise SpecError(
            f"architecture: {name}: written for contract version {found.contract_version}, this "
            f"torchrec-serve implements {CONTRACT_VERSION}"
        )
    return found


def check_forward(architecture: Architecture, spec: ModelSpec, model: nn.Module) -> None:
    """The model's ``forward`` takes the inputs the architecture declares, by name and in order."""
    declared = [t.name for t in architecture.input_tags(spec)]
    parameters = inspect.signature(model.forward).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return  # takes anything: nothing to compare
    taken = [p.name for p in parameters]
    if taken != declared:
        raise SpecError(
            f"architecture: {spec.architecture}: {type(model).__name__}.forward takes ({', '.join(taken)}), "
            f"its input_tags declare ({', '.join(declared)})"
        )


def parse_spec(raw: Any) -> ModelSpec:
    """A spec from parsed YAML; ``architecture`` (default ``dlrm``) picks its type. Raises
    ``SpecError`` naming every bad key's path."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"spec: must be a mapping, got {type(raw).__name__}")
    name = raw.get("architecture", DEFAULT_ARCHITECTURE)
    if not isinstance(name, str):
        raise SpecError(f"architecture: must be a name or an import path, got {name!r}")
    try:
        return resolve(name).spec_type.model_validate({**raw, "architecture": name})
    except ValidationError as error:
        raise SpecError("; ".join(_describe(e) for e in error.errors())) from None


def load_spec(path: str | Path) -> ModelSpec:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from e
    spec = parse_spec(raw)
    if spec.pruning is not None and not Path(spec.pruning).is_absolute():  # relative to the spec's folder
        spec = spec.replace(pruning=str(Path(path).resolve().parent / spec.pruning))
    return spec


def archive_spec(archive: Archive) -> ModelSpec:
    """An archive's spec, with the files it names taken out of a ``.mar`` beside it."""
    if archive.has(PRUNING):
        archive.file(PRUNING)
    return load_spec(archive.file(SPEC))


def input_schema(spec: ModelSpec) -> InputSchema:
    return architecture_of(spec).input_schema(spec)


def synthetic_request(
    spec: ModelSpec, num_items: int, seed: int, max_bag: int = 3, return_logits: bool = False,
    owned_ids: Mapping[str, torch.Tensor] | None = None,
) -> dict:
    return architecture_of(spec).synthetic_request(spec, num_items, seed, max_bag, return_logits, owned_ids)


def spec_json_schema() -> dict[str, Any]:
    """The JSON Schema a spec file of a shipped architecture satisfies: one of their spec types."""
    types = tuple(a.spec_type for a in shipped_architectures().values())
    schema = TypeAdapter(Union[types]).json_schema()  # type: ignore[valid-type]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "torchrec-serve model spec",
        **schema,
    }


_PATH_FIRST = re.compile(r"^[A-Za-z_][\w.\[\]]*: ")


def _describe(error: Any) -> str:
    """One pydantic error as ``key.path[i]: problem``."""
    location = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
    kind, message = error["type"], error["msg"]
    if kind == "missing":
        problem = "required key is missing"
    elif kind == "extra_forbidden":
        problem = "unknown key"
    elif kind == "too_short":
        problem = f"must hold at least {error['ctx']['min_length']}, got {error['input']!r}"
    elif kind == "value_error":
        problem = message.removeprefix("Value error, ")
        if _PATH_FIRST.match(problem):  # the check names the key below this location itself
            return f"{location}.{problem}" if location else problem
    else:
        problem = f"{message.replace('Input should be', 'must be')}, got {error['input']!r}"
    return f"{location}: {problem}" if location else problem
