"""A dense host's calls to one embedding shard: fail-over between its replicas within the
deadline, a 503 naming the shard when none answers, and a refusal or a malformed answer an
internal error."""

from __future__ import annotations

import concurrent.futures
import socket
import time

import numpy as np
import orjson
import pytest
import torch

from handlers.runtime.errors import InternalError, ShardUnavailable
from handlers.runtime.remote.lookups import ShardCaller
from handlers.runtime.remote.plan import Deadline, ShardRoute, read_placement
from handlers.runtime.wire.v2_tensors import encode_request


class _FakeShard:
    """A gRPC server speaking TorchServe's Predictions on a free loopback port: it answers every
    call with ``answer(request)`` (bytes) or aborts with ``code``."""

    def __init__(self, answer=None, code=None) -> None:
        import grpc

        from handlers.runtime.remote.grpc_stubs import messages

        self.calls = 0
        types = messages()

        def predictions(request, context):
            self.calls += 1
            if code is not None:
                context.abort(code, "refused by the fake shard")
            return types.PredictionResponse(prediction=answer(request))

        handler = grpc.method_handlers_generic_handler(
            "org.pytorch.serve.grpc.inference.InferenceAPIsService",
            {"Predictions": grpc.unary_unary_rpc_method_handler(
                predictions,
                request_deserializer=types.PredictionsRequest.FromString,
                response_serializer=types.PredictionResponse.SerializeToString,
            )},
        )
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(2), handlers=(handler,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None)


def _embeddings(request) -> bytes:
    """Each item's embeddings all 1, as a shard of one feature of width 2 answers them."""
    from handlers.runtime.wire.v2_tensors import DATATYPES

    lengths = orjson.loads(request.input["body"][: int(request.input["Inference-Header-Content-Length"])])
    items = lengths["inputs"][0]["shape"][1]
    blob = np.ones((items, 2), dtype=np.float32).tobytes()
    header = {"outputs": [{"name": "embeddings", "datatype": DATATYPES[np.dtype("float32")],
                           "shape": [items, 2], "parameters": {"binary_data_size": len(blob)}}]}
    return orjson.dumps(header) + blob


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once it is closed


def _request() -> tuple[bytes, int]:
    return encode_request({"sparse_features.lengths": np.array([[1, 0, 2]]), "sparse_features.values": np.array([4, 5, 6])},
                          outputs=("embeddings",))


def _caller(*replicas: str) -> ShardCaller:
    return ShardCaller(ShardRoute("a", "m-a", ("f",), (2,), replicas), Deadline(max_ms=500, retry_after_s=60))


def test_a_call_fails_over_from_a_dead_replica_and_says_which_failed():
    live = _FakeShard(answer=_embeddings)
    dead = _closed_port()
    caller = _caller(dead, live.address)
    try:
        assert caller.connect(timeout_s=1.0) == [dead]  # not connected: tried last from now on
        for _ in range(3):
            torch.testing.assert_close(caller.call(*_request()).result(), torch.ones(3, 2))
        assert live.calls == 3
        caller._down_until = [0.0, float("inf")]  # the dead one looks live, the live one failed lately
        torch.testing.assert_close(caller.call(*_request()).result(), torch.ones(3, 2))
        assert caller.counts[("ShardCalls", (("Shard", "a"), ("Outcome", "UNAVAILABLE")))] == 1
    finally:
        caller.close()
        live.stop()


def test_every_replica_down_is_a_503_naming_the_shard_within_its_deadline():
    caller = _caller(_closed_port(), _closed_port())
    try:
        started = time.perf_counter()
        with pytest.raises(ShardUnavailable) as unavailable:
            caller.call(*_request()).result()
        assert time.perf_counter() - started < 1.0
        assert unavailable.value.status == 503
        assert "embedding shard 'a' unavailable" in unavailable.value.message
        assert unavailable.value.message.count("UNAVAILABLE") == 2  # what each replica said
    finally:
        caller.close()


def test_a_shard_refusing_the_lookups_is_an_internal_error_not_a_fail_over():
    import grpc

    refusing = _FakeShard(code=grpc.StatusCode.INVALID_ARGUMENT)
    other = _FakeShard(answer=_embeddings)
    caller = _caller(refusing.address, other.address)
    try:
        caller.connect(timeout_s=2.0)
        with pytest.raises(InternalError, match="shard a refused the lookups: refused by the fake shard"):
            caller.call(*_request()).result()
        assert other.calls == 0  # the dense host sent something wrong: another replica would refuse it too
    finally:
        caller.close()
        refusing.stop()
        other.stop()


def test_an_answer_that_is_not_embeddings_is_an_internal_error():
    odd = _FakeShard(answer=lambda request: b'{"outputs": [{"name": "scores", "datatype": "FP32", "shape": [3], "data": [1, 2, 3]}]}')
    caller = _caller(odd.address)
    try:
        with pytest.raises(InternalError, match="shard a answered what is not embeddings"):
            caller.call(*_request()).result()
    finally:
        caller.close()
        odd.stop()


def test_a_placement_file_that_cannot_be_read_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"placement .*missing.yaml: cannot be read"):
        read_placement(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(ValueError, match="shards: must map each shard to its replicas"):
        read_placement(tmp_path / "list.yaml")
