"""The tensor wire format end to end: the project's client sends KServe v2 binary tensors over
TorchServe's REST and gRPC inference APIs, batched with other clients; scores equal the JSON
path's, and bad binary input is a 4xx naming the tensor."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import requests

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.client import ScoringClient
from archive_tools.local_server import LocalTorchServe
from handlers.runtime.remote.grpc_stubs import inference_stub
from handlers.runtime.remote.grpc_stubs import messages as grpc_messages
from handlers.runtime.wire.v2_headers import HEADER_LENGTH
from handlers.runtime.wire.v2_tensors import encode_request
from tests.conftest import RANKER_SPEC, TINY_SPEC
from tests.helpers import items_request

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("tensor") / "model_store"
    serving = ServingConfig(batch_size=16, max_batch_delay_ms=50)
    for spec, artifact in ((TINY_SPEC, "aoti"), (RANKER_SPEC, "eager")):
        from handlers.runtime.artifacts import Artifact

        build_archive(spec, checkpoint=None, seed=0, name=None, version="1.0", model_store=store,
                      serving=serving, artifact=Artifact(artifact))
    with LocalTorchServe(model_store=store) as server:
        for name in ("tiny", "ranker"):
            assert server.register(f"{name}.mar").status_code == 200
        yield server


def _clients(server, model: str) -> dict[str, ScoringClient]:
    archive = server.model_store / f"{model}.mar"
    token = server.keys.key("inference")
    return {  # REST with keys refreshed before they expire, gRPC with the key as a string
        "rest": ScoringClient.from_archive(model, archive, rest_url=server.inference_url, token=server.keys),
        "grpc": ScoringClient.from_archive(
            model, archive, grpc_target=f"127.0.0.1:{server.ports['grpc_inference_port']}", token=token
        ),
    }


def _json_scores(server, model: str, request: dict) -> list[float]:
    response = server.predict(model, request)
    assert response.status_code == 200, response.text
    return response.json()["scores"]


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_tensor_requests_score_like_json_batched_and_solo(server, tiny_spec, transport):
    client = _clients(server, "tiny")[transport]
    requests_ = [items_request(tiny_spec, n, seed=90 + n, max_bag=5) for n in (1, 7, 30, 2) * 4]
    with ThreadPoolExecutor(max_workers=len(requests_)) as pool:  # coalesced with each other
        scores = list(pool.map(lambda r: client.score(r["items"]), requests_))
    for request, got in zip(requests_, scores):
        assert got.dtype == np.float32 and got.shape == (len(request["items"]),)
        assert got.tolist() == pytest.approx(_json_scores(server, "tiny", request), abs=1e-6)
    client.close()


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_a_context_ranker_ranks_candidates(server, ranker_spec, transport):
    client = _clients(server, "ranker")[transport]
    request = items_request(ranker_spec, 12, seed=5, max_bag=4)
    ranking = client.rank(request["context"], request["items"])
    expected = _json_scores(server, "ranker", request)
    assert ranking.scores.tolist() == pytest.approx(expected, abs=1e-6)
    assert ranking.order.tolist() == sorted(range(12), key=lambda i: -expected[i])
    client.close()


def test_bad_binary_input_is_a_400_naming_the_tensor(server, tiny_spec):
    client = _clients(server, "tiny")["rest"]
    arrays = client.tensors(items_request(tiny_spec, 2, seed=1)["items"])
    body, json_length = encode_request(arrays)
    headers = {**server.auth("inference"), "Content-Type": "application/octet-stream"}
    url = f"{server.inference_url}/v2/models/tiny/infer"
    truncated = requests.post(url, data=body[:-8], headers={**headers, HEADER_LENGTH: str(json_length)}, timeout=30)
    assert truncated.status_code == 400
    assert "the body is shorter than the header says" in truncated.json()["error"]
    lying = requests.post(url, data=body, headers={**headers, HEADER_LENGTH: str(len(body) + 5)}, timeout=30)
    assert lying.status_code == 400 and lying.json()["error"].startswith(f"{HEADER_LENGTH}: must be")
    arrays["sparse_features.values"] = arrays["sparse_features.values"] + 10**6
    out_of_range = requests.post(url, data=encode_request(arrays)[0],
                                 headers={**headers, HEADER_LENGTH: str(encode_request(arrays)[1])}, timeout=30)
    assert out_of_range.status_code == 400
    assert "(sparse_features.values) (feature" in out_of_range.json()["error"]
    server.check_alive()


def test_a_grpc_refusal_names_the_tensor(server, tiny_spec):
    client = _clients(server, "tiny")["grpc"]
    items = items_request(tiny_spec, 1, seed=2)["items"]
    items[0]["dense"] = [float("nan")] * 4
    with pytest.raises(grpc.RpcError) as error:
        client.score(items)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs[0] (dense_features).data[0]: must be finite" in error.value.details()
    client.close()


def test_grpc_predictions_refused_alone_get_a_status_the_rest_of_the_batch_scores(server, tiny_spec):
    """With TorchServe's own inference.proto: a request the handler refuses is a non-OK gRPC
    status with its message (400: INVALID_ARGUMENT), not status OK with the error as the
    prediction; the good requests batched with it are answered with their scores."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.ports['grpc_inference_port']}")
    stub, messages = inference_stub(channel), grpc_messages()
    metadata = [(k.lower(), v) for k, v in server.auth("inference").items()]
    good = items_request(tiny_spec, 2, seed=5)
    bad = {"items": [{**good["items"][0], "dense": [0.1, 0.2]}]}

    def call(body: dict):
        request = messages.PredictionsRequest(model_name="tiny", input={"body": json.dumps(body).encode()})
        return stub.Predictions(request, metadata=metadata, timeout=30)

    with ThreadPoolExecutor(8) as pool:  # within one 50 ms batch: refused and scored side by side
        futures = [pool.submit(call, bad if k % 2 else good) for k in range(8)]
    for k, future in enumerate(futures):
        if k % 2:
            with pytest.raises(grpc.RpcError) as error:
                future.result()
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "items[0].dense: must hold 4 numbers, got 2" in error.value.details()
        else:
            assert json.loads(future.result().prediction)["scores"] == _json_scores(server, "tiny", good)
    channel.close()
