"""The references examples/kserve/'s manifests are checked against, offline:

* the Kubernetes API's JSON schemas that ``kubernetes-validate`` ships, strict (a field the API
  does not have is an error): whole core resources (``validate_core``), and every core-typed value
  inside a KServe resource (a container, its probes, env and resources, volumes, metadata);
* the KServe Python SDK's generated models (``kserve.models``) for KServe's own levels
  (``validate_kserve``): each level's field names (``attribute_map``), each value's type
  (``openapi_types``), and the fields the SDK's setters refuse to leave empty.

    validate_kserve(yaml.safe_load(open("examples/kserve/serving_runtime.yaml")))
    # ManifestError: spec.containers[0]: Additional properties are not allowed ('readinesProbe' ...)
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from functools import cache
from importlib.resources import files
from types import ModuleType
from typing import Any

import jsonschema
import kubernetes_validate
from referencing import Registry, Resource

K8S_VERSION = "1.33.0"  # the Kubernetes API the manifests are written for
KSERVE_GROUP = "serving.kserve.io"

# The SDK names a few core types otherwise than V1<Kind> (core/v1, or meta/v1 for ObjectMeta).
_CORE_NAMES = {
    "K8sIoApiAppsV1DeploymentStrategy": "io.k8s.api.apps.v1.DeploymentStrategy",
    "ResourceQuantity": "io.k8s.apimachinery.pkg.api.resource.Quantity",
}
_PRIMITIVES = {"str": str, "int": int, "float": (int, float), "bool": bool, "object": object}


class ManifestError(ValueError):
    """A manifest the references refuse: the field's path in the document, and why."""


def validate_core(resource: dict) -> None:
    """A core resource (a Secret, a Service, ...) against its strict Kubernetes API schema."""
    try:
        kubernetes_validate.validate(resource, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        raise ManifestError(f"{_path(error.absolute_path) or '.'}: {error.message}") from None


def validate_kserve(resource: dict) -> Any:
    """A ServingRuntime, InferenceService, ... as the SDK's model of its kind; returns that model."""
    group, _, version = resource.get("apiVersion", "").partition("/")
    if group != KSERVE_GROUP:
        raise ManifestError(f"apiVersion: {resource.get('apiVersion')!r} is not {KSERVE_GROUP}/...")
    kind = f"{version.capitalize()}{resource.get('kind', '')}"
    if not hasattr(kserve_models(), kind):
        raise ManifestError(f"kind: the KServe SDK has no {resource.get('kind')!r} in {version!r}")
    return _as_type(kind, resource, "")


@cache
def kserve_models() -> ModuleType:
    """``kserve.models``, without the SDK package's ``__init__``: that one imports KServe's model
    server, whose requirements (protobuf<7, psutil<6, pandas, fastapi) the project does not
    install; the models need only ``six`` and ``urllib3``."""
    spec = importlib.util.find_spec("kserve")
    if spec is None:
        raise ModuleNotFoundError("the KServe SDK is not installed (make setup installs it)")
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "kserve"}
    sys.modules["kserve"] = importlib.util.module_from_spec(spec)  # its __path__, not its __init__
    try:
        return importlib.import_module("kserve.models")
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == "kserve"]:
            del sys.modules[name]
        sys.modules.update(saved)


def _as_type(type_name: str, value: Any, where: str) -> Any:
    """``value`` as the SDK type ``type_name`` ('list[V1Container]', 'dict(str, str)', 'int', a
    KServe model, a core type), checked all the way down."""
    if element := re.fullmatch(r"list\[(.+)\]", type_name):
        _expect(list, value, where)
        return [_as_type(element[1], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if element := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        _expect(dict, value, where)
        return {key: _as_type(element[1], item, f"{where}.{key}") for key, item in value.items()}
    if type_name in _PRIMITIVES:
        if type_name == "int" and isinstance(value, bool):
            raise ManifestError(f"{where or '.'}: expected int, got a bool")
        _expect(_PRIMITIVES[type_name], value, where)
        return value
    model = getattr(kserve_models(), type_name, None)
    if model is None:
        _validate_core_value(type_name, value, where)
        return value
    return _as_model(model, value, where)


def _as_model(model: type, value: Any, where: str) -> Any:
    _expect(dict, value, where)
    python_names = {json_name: name for name, json_name in model.attribute_map.items()}
    arguments = {}
    for key, item in value.items():
        if key not in python_names:
            raise ManifestError(f"{_join(where, key)}: {model.__name__} has no field {key!r}")
        name = python_names[key]
        arguments[name] = _as_type(model.openapi_types[name], item, _join(where, key))
    try:
        return model(**arguments)  # the SDK's setters: the fields it requires
    except ValueError as error:
        raise ManifestError(f"{where or '.'}: {error}") from None


def _validate_core_value(type_name: str, value: Any, where: str) -> None:
    try:
        _core_validator(_core_definition(type_name)).validate(value)
    except jsonschema.ValidationError as error:
        raise ManifestError(f"{_join(where, _path(error.absolute_path)) or '.'}: {error.message}") from None


def _core_definition(type_name: str) -> str:
    """The Kubernetes schema's name for an SDK core type: V1Container -> io.k8s.api.core.v1.Container."""
    if type_name in _CORE_NAMES:
        return _CORE_NAMES[type_name]
    definitions = _core_definitions()["$defs"]
    kind = type_name.removeprefix("V1")
    for group in ("io.k8s.api.core.v1", "io.k8s.apimachinery.pkg.apis.meta.v1"):
        if type_name.startswith("V1") and f"{group}.{kind}" in definitions:
            return f"{group}.{kind}"
    raise LookupError(f"no Kubernetes schema for the KServe SDK's type {type_name!r}")


@cache
def _core_validator(definition: str) -> jsonschema.protocols.Validator:
    definitions = _core_definitions()
    schema = {"$id": "https://kubernetes.io/api/value.json", "$ref": f"_definitions.json#/$defs/{definition}"}
    registry = Resource.from_contents(definitions) @ Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


@cache
def _core_definitions() -> dict:
    """kubernetes-validate's strict definitions for K8S_VERSION (every core type, by full name)."""
    folder = files(kubernetes_validate) / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
    return json.loads((folder / "_definitions.json").read_text())


def _expect(kind: type | tuple, value: Any, where: str) -> None:
    if not isinstance(value, kind):
        raise ManifestError(f"{where or '.'}: expected {getattr(kind, '__name__', kind)}, got {value!r}")


def _join(where: str, key: str) -> str:
    """'spec' + 'containers' -> 'spec.containers'; 'spec.containers' + '[0]' -> 'spec.containers[0]'."""
    if not (where and key):
        return where or key
    return f"{where}{key}" if key.startswith("[") else f"{where}.{key}"


def _path(parts) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts).lstrip(".")
