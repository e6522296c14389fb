"""The Open Inference Protocol over gRPC (``ModelInfer``, TorchServe's own
``open_inference_grpc.proto`` from its frontend jar): tensors in, scores out, equal to the JSON
path's; a request the handler refuses is a non-OK status with its message, the rest of its batch
scored."""

from __future__ import annotations

import importlib
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import ts

from archive_tools.build import build_archive
from archive_tools.client import ScoringClient
from archive_tools.local_server import LocalTorchServe
from archive_tools.model_config import ServingConfig
from handlers.modeling.registry import input_schema
from tests.conftest import TINY_SPEC
from tests.helpers import items_request

pytestmark = pytest.mark.integration

FRONTEND_JAR = Path(ts.__file__).parent / "frontend" / "model-server.jar"
PROTO = "open_inference_grpc.proto"
DATATYPES = {"float32": "FP32", "int64": "INT64"}
CONTENTS = {"FP32": "fp32_contents", "INT64": "int64_contents"}


@pytest.fixture(scope="module")
def oip(tmp_path_factory):
    """(message module, service module) compiled from the proto TorchServe serves."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("oip")
    (out / PROTO).write_bytes(zipfile.ZipFile(FRONTEND_JAR).read(f"proto/{PROTO}"))
    include = Path(protoc.__file__).parent / "_proto"
    assert protoc.main(["protoc", f"-I{out}", f"-I{include}", f"--python_out={out}",
                        f"--grpc_python_out={out}", str(out / PROTO)]) == 0
    sys.path.insert(0, str(out))
    try:
        stem = PROTO.removesuffix(".proto")
        yield importlib.import_module(f"{stem}_pb2"), importlib.import_module(f"{stem}_pb2_grpc")
    finally:
        sys.path.remove(str(out))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("oip-store") / "model_store"
    build_archive(TINY_SPEC, checkpoint=None, seed=0, name=None, version="1.0", model_store=store,
                  serving=ServingConfig(batch_size=16, max_batch_delay_ms=50))
    with LocalTorchServe(model_store=store, settings={"ts_open_inference_protocol": "true"}) as server:
        assert server.register("tiny.mar").status_code == 200
        yield server


def _infer_request(messages, spec, request: dict, request_id: str):
    """A ModelInferRequest holding the request's tensors, as the project's client lays them out."""
    schema = input_schema(spec)
    client = ScoringClient(schema.model, schema, rest_url="http://127.0.0.1")
    tensors = []
    for name, array in client.tensors(request["items"], request.get("context")).items():
        datatype = DATATYPES[array.dtype.name]
        contents = messages.InferTensorContents(**{CONTENTS[datatype]: array.reshape(-1).tolist()})
        tensors.append(messages.ModelInferRequest.InferInputTensor(
            name=name, datatype=datatype, shape=list(array.shape), contents=contents,
        ))
    return messages.ModelInferRequest(model_name="tiny", id=request_id, inputs=tensors)


def test_model_infer_scores_as_json_and_a_refusal_is_invalid_argument(server, oip, tiny_spec):
    messages, services = oip
    channel = grpc.insecure_channel(f"127.0.0.1:{server.ports['grpc_inference_port']}")
    stub = services.GRPCInferenceServiceStub(channel)
    metadata = [(k.lower(), v) for k, v in server.auth("inference").items()]
    good = items_request(tiny_spec, 3, seed=7)
    first = tiny_spec.feature_names[0]
    bad = {"items": [{**good["items"][0], "sparse": {first: [-5]}}]}
    expected = server.predict("tiny", good).json()["scores"]

    def call(k: int):
        request = _infer_request(messages, tiny_spec, bad if k % 2 else good, f"r{k}")
        return stub.ModelInfer(request, metadata=metadata, timeout=30)

    with ThreadPoolExecutor(8) as pool:  # within one 50 ms batch: refused and scored side by side
        futures = [pool.submit(call, k) for k in range(8)]
    for k, future in enumerate(futures):
        if k % 2:
            with pytest.raises(grpc.RpcError) as error:
                future.result()
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = error.value.details()
            assert f"(sparse_features.values) (feature {first}, item 0, id 0): ids must be >= 0, got -5" in details
            assert details.endswith("got -5"), details  # the message alone: no Java class name after it
        else:
            answer = future.result()
            assert answer.id == f"r{k}" and answer.model_name == "tiny" and answer.model_version == "1.0"
            (scores,) = answer.outputs
            assert scores.name == "scores" and list(scores.shape) == [3]
            assert list(scores.contents.fp32_contents) == pytest.approx(expected, abs=1e-6)
    channel.close()
    server.check_alive()
