"""The ASGI engine's gRPC service, the Open Inference Protocol's ``inference.GRPCInferenceService``,
called by Triton's gRPC client and by stubs of Triton's own ``grpc_service.proto`` (the
independent reference: the engine compiles its own ``.proto``). Checked against the REST v2 route
of the same server, the archive loaded in this process and the float model it was built from:
the same scores; the same field messages, as gRPC statuses a client can act on; batches shared
with REST requests; keys on every call. One server for the module (one process).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import torch
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2, service_pb2_grpc

from archive_tools.build import build_archive
from archive_tools.client import ScoringClient
from archive_tools.model_config import ServingConfig
from handlers.modeling.registry import input_schema
from handlers.runtime.wire.v2_headers import HEADER_LENGTH
from handlers.runtime.wire.v2_tensors import DATATYPES, encode_request
from tests.conftest import TINY_SPEC
from tests.helpers import QUANTIZATION_TOLERANCE, archive_service, float_scores, items_request
from tests.integration.engines import AsgiServer

pytestmark = pytest.mark.integration

GUARDED = "tiny_guarded"  # one request per batch, a 1 ms wait target: a second request waiting is shed
PATIENT = "tiny_patient"  # batches of 8 collected for up to 500 ms; requests of at most 4 KiB
PATIENT_BATCH, PATIENT_LIMIT = 8, 4096
CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT64": "int64_contents"}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("asgi-grpc")
    store = folder / "model_store"
    build_archive(TINY_SPEC, checkpoint=None, seed=0, name="tiny", version="1.0", model_store=store,
                  serving=ServingConfig(batch_size=8, max_batch_delay_ms=20))
    build_archive(TINY_SPEC, checkpoint=None, seed=0, name=GUARDED, version="1.0", model_store=store,
                  serving=ServingConfig(batch_size=1, max_batch_delay_ms=1, max_queue_wait_ms=1))
    small = folder / "tiny_small.yaml"
    text = TINY_SPEC.read_text()
    assert "\nlimits:\n" in text
    small.write_text(text.replace("\nlimits:\n", f"\nlimits:\n  max_request_bytes: {PATIENT_LIMIT}\n"))
    build_archive(small, checkpoint=None, seed=0, name=PATIENT, version="1.0", model_store=store,
                  serving=ServingConfig(batch_size=PATIENT_BATCH, max_batch_delay_ms=500))
    return store


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    archives = ["tiny.mar", f"{GUARDED}.mar", f"{PATIENT}.mar"]
    server = AsgiServer(store, archives, 1, tmp_path_factory.mktemp("asgi-grpc-server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def keyed(server) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {server.key}")]


def _arrays(spec, request: dict) -> dict[str, np.ndarray]:
    """The request's tensors, as the project's client lays them out."""
    schema = input_schema(spec)
    return ScoringClient(schema.model, schema, rest_url="http://127.0.0.1").tensors(request["items"])


def _typed(arrays: dict, model: str = "tiny", outputs: tuple[str, ...] = (), request_id: str = ""):
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, array in arrays.items():
        datatype = DATATYPES[array.dtype]
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        getattr(tensor.contents, CONTENTS[datatype]).extend(array.reshape(-1).tolist())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def _raw(arrays: dict, model: str = "tiny", outputs: tuple[str, ...] = ()):
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, array in arrays.items():
        request.inputs.add(name=name, datatype=DATATYPES[array.dtype], shape=list(array.shape))
        request.raw_input_contents.append(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def _rest_json(arrays: dict, outputs: tuple[str, ...] = ()) -> dict:
    body = {"inputs": [{"name": name, "datatype": DATATYPES[a.dtype], "shape": list(a.shape),
                        "data": a.reshape(-1).tolist()} for name, a in arrays.items()]}
    if outputs:
        body["outputs"] = [{"name": name} for name in outputs]
    return body


def _rest_binary(server: AsgiServer, arrays: dict, model: str = "tiny"):
    body, json_length = encode_request(arrays)
    return server.post(f"/v2/models/{model}/infer", body,
                       headers={"Content-Type": "application/octet-stream", HEADER_LENGTH: str(json_length)})


def _refusal(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as refused:
        call(*args, **kwargs)
    return refused.value.code(), refused.value.details()


def test_scores_are_rest_s_the_archive_s_and_the_float_model_s(server, store, stub, keyed, tiny_spec, tiny_float_model):
    reference = archive_service(store / "tiny.mar")
    client = triton.InferenceServerClient(server.grpc_target)
    both = ("scores", "logits")
    for n, seed in ((1, 1), (5, 2), (40, 3)):
        request = items_request(tiny_spec, n, seed=seed, max_bag=5)
        arrays = _arrays(tiny_spec, request)
        rest = server.post("/v2/models/tiny/infer", _rest_json(arrays, both)).json()
        expected = {o["name"]: o["data"] for o in rest["outputs"]}

        inputs = []
        for name, array in arrays.items():  # Triton's client sends raw_input_contents
            tensor = triton.InferInput(name, list(array.shape), DATATYPES[array.dtype])
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        raw = client.infer("tiny", inputs, outputs=[triton.InferRequestedOutput(o) for o in both],
                           request_id=f"raw{n}", headers=dict(keyed))
        answer = raw.get_response()
        assert (answer.model_name, answer.model_version, answer.id) == ("tiny", "1.0", f"raw{n}")
        assert len(answer.raw_output_contents) == 2  # raw in, raw out
        typed = stub.ModelInfer(_typed(arrays, outputs=both, request_id=f"typed{n}"), metadata=keyed, timeout=30)
        assert typed.id == f"typed{n}" and not typed.raw_output_contents
        for k, name in enumerate(both):
            assert list(raw.as_numpy(name).shape) == [n] and list(typed.outputs[k].shape) == [n]
            assert raw.as_numpy(name).tolist() == pytest.approx(expected[name], abs=1e-6)
            assert list(typed.outputs[k].contents.fp32_contents) == pytest.approx(expected[name], abs=1e-6)

        alone = json.loads(reference.handle([json.dumps(request).encode()]).responses[0].body)
        assert raw.as_numpy("scores").tolist() == pytest.approx(alone["scores"], abs=1e-6)
        floats = float_scores(tiny_float_model, tiny_spec, request)
        torch.testing.assert_close(torch.tensor(raw.as_numpy("scores")), floats, atol=QUANTIZATION_TOLERANCE, rtol=0)
    client.close()


def test_grpc_and_rest_requests_share_one_batch(server, stub, keyed, tiny_spec):
    """PATIENT's batch of 8 fills within its 500 ms only if both transports feed one queue. An
    idle HTTP connection stays open meanwhile: with every open HTTP connection waiting on the
    batch, it would run without waiting for the gRPC calls (connections.py)."""
    before = server.stats(PATIENT)
    idle = requests.Session()
    assert idle.get(f"{server.url}/ping", timeout=10).status_code == 200
    requests_ = [items_request(tiny_spec, 1 + k, seed=50 + k, max_bag=4) for k in range(PATIENT_BATCH // 2)]
    arrays = [_arrays(tiny_spec, r) for r in requests_]
    with ThreadPoolExecutor(max_workers=len(arrays)) as pool:
        over_rest = [pool.submit(server.post, f"/v2/models/{PATIENT}/infer", _rest_json(a)) for a in arrays]
        over_grpc = [stub.ModelInfer.future(_raw(a, PATIENT), metadata=keyed, timeout=30) for a in arrays]
        rest = [f.result().json()["outputs"][0]["data"] for f in over_rest]
    for answer, expected in zip([f.result() for f in over_grpc], rest):
        assert np.frombuffer(answer.raw_output_contents[0], "<f4").tolist() == pytest.approx(expected, abs=1e-6)
    formed = {size: count - before.get(size, 0) for size, count in server.stats(PATIENT).items()}
    idle.close()
    assert {size: count for size, count in formed.items() if count} == {PATIENT_BATCH: 1}


def _bad_cases(arrays: dict) -> list[dict]:
    """Requests the decoder refuses, as tensors: a wrong shape, a negative id, an unknown input, a
    missing one, a datatype it does not take."""
    dense, _, values = arrays
    negative = arrays[values].copy()
    negative[0] = -5
    return [
        {**arrays, dense: arrays[dense][:, :3].copy()},
        {**arrays, values: negative},
        {**arrays, "colour": np.ones(1, np.float32)},
        {dense: arrays[dense], values: arrays[values]},
        {**arrays, values: arrays[values].astype(np.float64)},
    ]


def test_bad_input_is_invalid_argument_with_rest_s_message(server, stub, keyed, tiny_spec):
    arrays = _arrays(tiny_spec, items_request(tiny_spec, 2, seed=7, max_bag=3))
    for case in _bad_cases(arrays):
        rest_json = server.post("/v2/models/tiny/infer", _rest_json(case))
        rest_binary = _rest_binary(server, case)
        assert rest_json.status_code == rest_binary.status_code == 400, (rest_json.text, rest_binary.text)
        typed = _refusal(stub.ModelInfer, _typed(case), metadata=keyed)
        raw = _refusal(stub.ModelInfer, _raw(case), metadata=keyed)
        assert typed == (grpc.StatusCode.INVALID_ARGUMENT, rest_json.json()["error"])
        assert raw == (grpc.StatusCode.INVALID_ARGUMENT, rest_binary.json()["error"])
    first = tiny_spec.feature_names[0]
    negative = _bad_cases(arrays)[1]
    assert _refusal(stub.ModelInfer, _raw(negative), metadata=keyed) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"inputs[2] (sparse_features.values) (feature {first}, item 0, id 0): ids must be >= 0, got -5",
    )  # the message alone

    # what only the gRPC form can get wrong, named as the decoder names fields
    short = _raw(arrays)
    del short.raw_input_contents[-1]
    assert _refusal(stub.ModelInfer, short, metadata=keyed) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "raw_input_contents: 2 entries for 3 inputs: give one per input, in their order",
    )
    misplaced = _typed(arrays)
    lengths = misplaced.inputs[1]
    lengths.contents.fp32_contents.extend(lengths.contents.int64_contents)
    lengths.contents.ClearField("int64_contents")
    assert _refusal(stub.ModelInfer, misplaced, metadata=keyed) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "inputs[1] (sparse_features.lengths).contents: INT64 values go in int64_contents, got fp32_contents",
    )
    both = _raw(arrays)
    both.inputs[0].contents.fp32_contents.append(1.0)
    assert _refusal(stub.ModelInfer, both, metadata=keyed) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "inputs[0] (dense_features).contents: given with raw_input_contents: send each input's values in one of them",
    )


CALLS = [
    ("ServerLive", service_pb2.ServerLiveRequest()),
    ("ServerReady", service_pb2.ServerReadyRequest()),
    ("ModelReady", service_pb2.ModelReadyRequest(name="tiny")),
    ("ServerMetadata", service_pb2.ServerMetadataRequest()),
    ("ModelMetadata", service_pb2.ModelMetadataRequest(name="tiny")),
    ("ModelInfer", service_pb2.ModelInferRequest(model_name="tiny")),
]


def test_a_missing_or_wrong_key_is_unauthenticated_on_every_call(server, stub):
    for method, request in CALLS:
        for metadata in ([], [("authorization", "Bearer not-the-key")], [("authorization", server.key)]):
            code, details = _refusal(getattr(stub, method), request, metadata=metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (method, metadata, details)
            assert details.startswith("Token Authorization failed"), details


def test_health_and_metadata(server, stub, keyed):
    assert stub.ServerLive(service_pb2.ServerLiveRequest(), metadata=keyed).live
    assert stub.ServerReady(service_pb2.ServerReadyRequest(), metadata=keyed).ready
    for version in ("", "1.0"):
        assert stub.ModelReady(service_pb2.ModelReadyRequest(name="tiny", version=version), metadata=keyed).ready
    described = stub.ServerMetadata(service_pb2.ServerMetadataRequest(), metadata=keyed)
    assert described.name == "torchrec-serve" and list(described.extensions) == []
    expected = requests.get(f"{server.url}/v2/models/tiny", headers=server.auth, timeout=10).json()
    metadata = stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="tiny"), metadata=keyed)
    as_rest = {
        "name": metadata.name, "versions": list(metadata.versions), "platform": metadata.platform,
        **{kind: [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in getattr(metadata, kind)]
           for kind in ("inputs", "outputs")},
    }
    assert as_rest == expected
    client = triton.InferenceServerClient(server.grpc_target)
    headers = dict(keyed)
    assert client.is_server_live(headers=headers) and client.is_server_ready(headers=headers)
    assert client.is_model_ready("tiny", "1.0", headers=headers)
    assert client.get_model_metadata("tiny", headers=headers).versions == ["1.0"]
    client.close()


def test_unknown_models_are_not_found(server, stub, keyed):
    rest = server.post("/v2/models/nope/infer", {"inputs": []}).json()["error"]
    calls = [
        (stub.ModelInfer, service_pb2.ModelInferRequest(model_name="nope"), rest),
        (stub.ModelMetadata, service_pb2.ModelMetadataRequest(name="nope"), rest),
        (stub.ModelReady, service_pb2.ModelReadyRequest(name="nope"), rest),
        (stub.ModelInfer, service_pb2.ModelInferRequest(model_name="tiny", model_version="9.9"),
         "Model version: 9.9 does not exist for model: tiny"),
    ]
    for call, request, message in calls:
        assert _refusal(call, request, metadata=keyed) == (grpc.StatusCode.NOT_FOUND, message)


def test_a_request_over_the_limit_is_resource_exhausted(server, stub, keyed, tiny_spec):
    arrays = _arrays(tiny_spec, items_request(tiny_spec, 100, seed=5, max_bag=4))
    rest = _rest_binary(server, arrays, PATIENT)
    assert rest.status_code == 413
    pattern = rf"body: [\d,]+ bytes, over the model's limit of {PATIENT_LIMIT:,} \(limits.max_request_bytes\)"
    assert re.fullmatch(pattern, rest.json()["message"]), rest.text  # TorchServe's 413 body, on every route
    code, details = _refusal(stub.ModelInfer, _raw(arrays, PATIENT), metadata=keyed)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and re.fullmatch(pattern, details), details
    huge = service_pb2.ModelInferRequest(model_name="tiny", raw_input_contents=[bytes(7 << 20)])  # over every model's
    code, details = _refusal(stub.ModelInfer, huge, metadata=keyed)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details, details
    assert stub.ServerLive(service_pb2.ServerLiveRequest(), metadata=keyed).live


def test_requests_over_the_wait_target_are_unavailable(server, stub, keyed, tiny_spec):
    """As the REST route's 503s: GUARDED takes one 250-item request per batch, over its 1 ms
    target; once a batch was measured with requests behind it, one arriving while another waits
    is shed before it reaches a forward."""
    request = _raw(_arrays(tiny_spec, items_request(tiny_spec, 250, seed=9, max_bag=8)), GUARDED)
    before = sum(size * count for size, count in server.stats(GUARDED).items())
    expected = stub.ModelInfer(request, metadata=keyed, timeout=30).raw_output_contents[0]
    outcomes: list = []
    for burst in (4, 24, 24, 24):  # until one was shed: a loaded machine may hand the calls over one by one
        futures = [stub.ModelInfer.future(request, metadata=keyed, timeout=30) for _ in range(burst)]
        outcomes += [f.exception() or f.result() for f in futures]
        if any(isinstance(o, grpc.RpcError) for o in outcomes):
            break
    shed = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    served = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
    assert shed and served, outcomes
    assert all(o.code() == grpc.StatusCode.UNAVAILABLE for o in shed), [o.code() for o in shed]
    assert all(o.raw_output_contents[0] == expected for o in served)
    details = shed[0].details()
    assert details.startswith(f"model {GUARDED} version 1.0 is overloaded") and "max_queue_wait_ms" in details
    forwarded = sum(size * count for size, count in server.stats(GUARDED).items()) - before
    assert forwarded == 1 + len(served), (forwarded, len(served), len(shed))
