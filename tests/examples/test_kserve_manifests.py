"""examples/kserve/'s manifests, checked offline: no cluster, no network (kserve_schemas.py).

Checked:
* the ServingRuntime and the InferenceService, each KServe level against the KServe SDK's
  generated models (kserve 0.21.0: field names, value types, the fields its setters require), and
  each core-typed value inside them (containers, probes, env, resources, security context, volumes,
  metadata) against kubernetes-validate's strict Kubernetes 1.33 schemas; the Secret whole against
  its schema. A misspelled field, at either level, is refused by name (the tests that break them);
* that they fit together as KServe pairs them: the InferenceService's runtime, model format and
  protocol are the ServingRuntime's (and so are those of its commented gRPC variant, whose port
  is the engine's --grpc-port); the key file the container
  reads is the Secret's, in the engine's form; the probes ask the
  container's port (8080, where KServe sends requests) for /v2/health/ready and /v2/health/live; the
  runtime serves {{.Name}}.mar from /mnt/models, where KServe puts the storageUri's content.

Not checked: what KServe's controller and webhooks do beyond its models (defaults, the storageUri
scheme and the storage initializer, rendering {{.Name}}, merging the predictor into the runtime's
container), that a cluster's installed CRDs are 0.21.0's, admission policies (quotas, pod
security), the image (test_kserve_image.py compares its install steps with the Makefile's; no docker
here), and that the engine answers on those routes (the engine's own tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.examples.kserve_schemas import ManifestError, validate_core, validate_kserve

KSERVE = Path(__file__).resolve().parents[2] / "examples" / "kserve"


def _manifest(name: str) -> dict:
    (document,) = yaml.safe_load_all((KSERVE / name).read_text())
    return document


@pytest.fixture
def runtime() -> dict:
    return _manifest("serving_runtime.yaml")


@pytest.fixture
def service() -> dict:
    return _manifest("inference_service.yaml")


@pytest.fixture
def secret() -> dict:
    return _manifest("secret.yaml")


@pytest.mark.parametrize(
    "name, model", [("serving_runtime.yaml", "V1alpha1ServingRuntime"),
                    ("inference_service.yaml", "V1beta1InferenceService")],
)
def test_kserve_kinds_are_the_sdks_models(name, model):
    assert type(validate_kserve(_manifest(name))).__name__ == model


def test_the_secret_is_a_kubernetes_secret(secret):
    validate_core(secret)


# (manifest, path to a field, its misspelling: the refusal names it)
MISSPELLINGS = [
    ("serving_runtime.yaml", ["spec", "supportedModelFormats"], "supportedModelFormat"),
    ("serving_runtime.yaml", ["spec", "supportedModelFormats", 0, "autoSelect"], "autoselect"),
    ("serving_runtime.yaml", ["spec", "containers", 0, "readinessProbe"], "readinesProbe"),
    ("serving_runtime.yaml", ["spec", "containers", 0, "livenessProbe", "httpGet", "path"], "pth"),
    ("inference_service.yaml", ["spec", "predictor", "model", "storageUri"], "storageURI"),
    ("inference_service.yaml", ["spec", "predictor", "model", "modelFormat"], "modelformat"),
    ("inference_service.yaml", ["metadata", "name"], "nmae"),
    ("secret.yaml", ["stringData"], "stringdata"),
]


@pytest.mark.parametrize("name, path, misspelled", MISSPELLINGS)
def test_a_misspelled_field_is_refused_by_name(name, path, misspelled):
    document = _manifest(name)
    *parents, field = path
    holder = document
    for key in parents:
        holder = holder[key]
    holder[misspelled] = holder.pop(field)
    validate = validate_core if document["apiVersion"] == "v1" else validate_kserve
    with pytest.raises(ManifestError, match=f"'{misspelled}'"):
        validate(document)


def test_a_value_of_the_wrong_type_is_refused(runtime):
    runtime["spec"]["supportedModelFormats"][0]["version"] = 1  # YAML's unquoted 1: an int
    with pytest.raises(ManifestError, match=r"supportedModelFormats\[0\]\.version: expected str"):
        validate_kserve(runtime)


def test_a_field_the_sdk_requires_is_required(runtime):
    del runtime["spec"]["containers"]
    with pytest.raises(ManifestError, match="containers"):
        validate_kserve(runtime)


def test_the_inference_service_is_given_the_runtime(runtime, service):
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {entry["name"]: entry for entry in runtime["spec"]["supportedModelFormats"]}
    assert formats[model["modelFormat"]["name"]]["autoSelect"] is True
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]


def test_the_grpc_variant_in_the_comment_is_valid_and_the_runtime_s(runtime, service):
    """inference_service.yaml's commented lines for gRPC, applied: a valid InferenceService whose
    protocol the runtime takes, naming the port the engine serves gRPC on."""
    lines = (KSERVE / "inference_service.yaml").read_text().splitlines()
    commented = [line.strip().removeprefix("#   ") for line in lines if line.strip().startswith("#   ")]
    variant = yaml.safe_load("\n".join(commented))
    assert set(variant) == {"protocolVersion", "ports"}
    model = service["spec"]["predictor"]["model"]
    model.update(variant)
    validate_kserve(service)
    assert model["protocolVersion"] == "grpc-v2" and model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    (port,) = model["ports"]
    (container,) = runtime["spec"]["containers"]
    assert port["name"] == "h2c" and f"--grpc-port={port['containerPort']}" in container["args"]


def test_the_container_reads_its_key_from_the_secret(runtime, secret):
    """The Secret's keys.json, mounted where --key-file names it, in the engine's key file form."""
    (container,) = runtime["spec"]["containers"]
    (key_file,) = [arg.removeprefix("--key-file=") for arg in container["args"] if arg.startswith("--key-file=")]
    volumes = {volume["name"]: volume for volume in runtime["spec"]["volumes"]}
    (mount,) = [mount for mount in container["volumeMounts"] if "secret" in volumes[mount["name"]]]
    assert volumes[mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"]
    assert key_file == f"{mount['mountPath']}/keys.json"
    assert json.loads(secret["stringData"]["keys.json"])["inference"]["key"]


def test_the_probes_ask_the_served_port_for_v2_health(runtime):
    (container,) = runtime["spec"]["containers"]
    (port,) = container["ports"]
    assert port["containerPort"] == 8080  # where KServe sends a predictor's HTTP requests
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}


def test_the_runtime_serves_the_archive_named_after_the_service(runtime):
    (container,) = runtime["spec"]["containers"]
    assert "--model-store=/mnt/models" in container["args"]  # where KServe puts storageUri's content
    assert "{{.Name}}.mar" in container["args"]
