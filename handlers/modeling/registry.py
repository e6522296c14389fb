"""The architectures a spec can name, and everything that needs one: spec parsing, the input
schema, synthetic requests, the JSON Schema of spec files.

An architecture is any module in ``handlers/modeling/architectures/`` that defines
``ARCHITECTURE`` (an ``Architecture``); nothing else lists them.

    spec = load_spec("config/models/criteo.yaml")        # the architecture's own spec type
    architecture_of(spec).build(spec, ebc, device)
    input_schema(spec)                                   # what the runtime decodes and batches
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from pathlib import Path
from typing import Any, Mapping, Union

import yaml
from pydantic import TypeAdapter, ValidationError

import handlers.modeling.architectures as _package
from handlers.modeling.architecture import Architecture
from handlers.modeling.errors import SpecError
from handlers.modeling.spec import ModelSpec
from handlers.runtime.inputs import InputSchema

DEFAULT_ARCHITECTURE = "dlrm"


@functools.cache
def architectures() -> dict[str, Architecture]:
    """Every architecture module's ``ARCHITECTURE``, by name."""
    found: dict[str, Architecture] = {}
    for info in sorted(pkgutil.iter_modules(_package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{_package.__name__}.{info.name}")
        architecture = getattr(module, "ARCHITECTURE", None)
        if isinstance(architecture, Architecture):
            found[architecture.name] = architecture
    return found


def architecture_of(spec: ModelSpec) -> Architecture:
    return architectures()[spec.architecture]


def parse_spec(raw: Any) -> ModelSpec:
    """A spec from parsed YAML; ``architecture`` (default ``dlrm``) picks its type. Raises
    ``SpecError`` naming every bad key's path."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"spec: must be a mapping, got {type(raw).__name__}")
    name = raw.get("architecture", DEFAULT_ARCHITECTURE)
    known = architectures()
    if name not in known:
        raise SpecError(f"architecture: must be one of {', '.join(known)}, got {name!r}")
    try:
        return known[name].spec_type.model_validate({**raw, "architecture": name})
    except ValidationError as error:
        raise SpecError("; ".join(_describe(e) for e in error.errors())) from None


def load_spec(path: str | Path) -> ModelSpec:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from e
    return parse_spec(raw)


def input_schema(spec: ModelSpec) -> InputSchema:
    return architecture_of(spec).input_schema(spec)


def synthetic_request(
    spec: ModelSpec, num_items: int, seed: int, max_bag: int = 3, return_logits: bool = False
) -> dict:
    return architecture_of(spec).synthetic_request(spec, num_items, seed, max_bag, return_logits)


def spec_json_schema() -> dict[str, Any]:
    """The JSON Schema a spec file satisfies: one of the architectures' spec types."""
    types = tuple(a.spec_type for a in architectures().values())
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
