"""Decoding KServe v2 (Open Inference Protocol) requests, JSON and binary tensors: the same
model inputs as the items form, and every problem named by its tensor."""

import json

import numpy as np
import orjson
import pytest
import torch

from handlers.modeling.architecture import CONTEXT_INPUT, DENSE_INPUT, SPARSE_INPUT
from handlers.modeling.registry import input_schema
from handlers.runtime.errors import BadRequest
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.messages import BinaryBody, Rejected
from handlers.runtime.wire.v2_tensors import decode_response, encode_request


def _decode_payload(spec, payload):
    try:
        return RequestDecoder(input_schema(spec)).decode(payload)
    except Rejected as refusal:
        raise refusal.error from None


def _decode(spec, body):
    """Decodes ``body`` (sent as JSON bytes); a refusal raises its ``BadRequest``."""
    return _decode_payload(spec, body if isinstance(body, bytes) else json.dumps(body).encode())


# -- KServe v2 / Open Inference Protocol -----------------------------------------------------------


def _v2(dense, lengths, values, **extra):
    features = len(lengths)
    inputs = [
        {"name": "dense_features", "datatype": "FP32", "shape": [len(dense), len(dense[0])], "data": dense},
        {"name": "sparse_features.lengths", "datatype": "INT64", "shape": [features, len(dense)],
         "data": [x for row in lengths for x in row]},
        {"name": "sparse_features.values", "datatype": "INT64", "shape": [len(values)], "data": values},
    ]
    return {"id": "req-1", "inputs": inputs, **extra}


def test_v2_request_decodes_like_the_items_form(tiny_spec):
    items = _decode(tiny_spec, {"items": [
        {"dense": [1, 2, 3, 4], "sparse": {"user_id": [5, 6], "category": [7]}},
        {"dense": [5, 6, 7, 8], "sparse": {"user_id": [9], "hour": [23]}},
    ]})
    v2 = _decode(tiny_spec, _v2(
        [[1, 2, 3, 4], [5, 6, 7, 8]], [[2, 1], [0, 0], [0, 0], [1, 0], [0, 1]], [5, 6, 9, 7, 23]
    ))
    for name in (DENSE_INPUT, SPARSE_INPUT):
        assert str(v2.inputs.tensors[name]) == str(items.inputs.tensors[name])
    answer = orjson.loads(v2.encoder.answer(torch.tensor([0.0, 1.0])).body)
    assert answer["id"] == "req-1" and answer["model_name"] == "tiny"
    assert answer["outputs"] == [
        {"name": "scores", "datatype": "FP32", "shape": [2], "data": [0.5, pytest.approx(0.7310586)]}
    ]


def test_v2_outputs_may_ask_for_logits(tiny_spec):
    body = _v2([[1, 2, 3, 4]], [[0]] * 5, [], outputs=[{"name": "logits"}, {"name": "scores"}])
    answer = orjson.loads(_decode(tiny_spec, body).encoder.answer(torch.tensor([2.0])).body)
    assert [o["name"] for o in answer["outputs"]] == ["logits", "scores"]
    assert answer["outputs"][0]["data"] == [2.0]


V2_BAD_REQUESTS = [
    (lambda b: b["inputs"].pop(2), "inputs", "input 'sparse_features.values' is required"),
    (lambda b: b["inputs"][0].update(name="dense"), "inputs[0].name", "unknown input 'dense'"),
    (lambda b: b["inputs"][0].update(datatype="BYTES"), "inputs[0] (dense_features).datatype", "must be one of"),
    (lambda b: b["inputs"][0].update(shape=[1, 5]), "inputs[0] (dense_features).shape", "must be [n, 4], got [1, 5]"),
    (lambda b: b["inputs"][2].update(shape=[2], data=[1, 2]), "inputs[2] (sparse_features.values).shape", "must be [1]"),
    (lambda b: b["inputs"][2].update(data=[5000]), "inputs[2] (sparse_features.values) (feature user_id, item 0, id 0)", "outside the table's 1000 rows"),
    (lambda b: b["inputs"][0].update(data=[[1, 2, 3, "x"]]), "inputs[0] (dense_features).data[3]", "must be a number"),
    (lambda b: b["inputs"][0].update(data=[1, 2, 3]), "inputs[0] (dense_features).data", "shape [1, 4] needs 4 values, got 3"),
    (lambda b: b.update(outputs=[{"name": "probabilities"}]), "outputs[0].name", "must be one of ['scores', 'logits']"),
    (lambda b: b.update(extra=1), "extra", "unknown field"),
]


@pytest.mark.parametrize("mutate, field, problem", V2_BAD_REQUESTS)
def test_bad_v2_request_names_the_field_in_a_v2_error(tiny_spec, mutate, field, problem):
    body = _v2([[1, 2, 3, 4]], [[1], [0], [0], [0], [0]], [7])
    mutate(body)
    with pytest.raises(Rejected) as refusal:
        RequestDecoder(input_schema(tiny_spec)).decode(json.dumps(body))
    assert refusal.value.error.field == field and problem in refusal.value.error.message
    response = refusal.value.response()
    assert response.status == 400
    assert orjson.loads(response.body) == {"error": f"{field}: {refusal.value.error.message.split(': ', 1)[1]}"}


def test_v2_request_of_a_ranker_carries_context_and_weights(ranker_spec):
    body = _v2([[0.1, 0.2, 0.3]], [[1], [2], [0]], [4, 17, 18])
    body["inputs"] += [
        {"name": "sparse_features.weights", "datatype": "FP32", "shape": [3], "data": [1, 0.5, 2]},
        {"name": "context_features", "datatype": "FP32", "shape": [1, 8], "data": [[0.3] * 8]},
    ]
    decoded = _decode(ranker_spec, body)
    assert decoded.inputs.tensors[SPARSE_INPUT].weights.tolist() == [1, 0.5, 2]
    assert decoded.inputs.tensors[CONTEXT_INPUT].shape == (1, 8)
    del body["inputs"][-1]
    with pytest.raises(BadRequest, match="input 'context_features' is required"):
        _decode(ranker_spec, body)


# -- KServe v2 binary tensors ------------------------------------------------------------------


def _binary(dense, lengths, values, **inputs):
    arrays = {
        "dense_features": np.asarray(dense, dtype=np.float32),
        "sparse_features.lengths": np.asarray(lengths, dtype=np.int64),
        "sparse_features.values": np.asarray(values, dtype=np.int64),
        **inputs,
    }
    return BinaryBody(*encode_request(arrays, outputs=("scores", "logits")))


def _decode_binary(spec, body):
    try:
        return RequestDecoder(input_schema(spec)).decode(body)
    except Rejected as refusal:
        raise refusal.error from None


def test_binary_tensors_decode_like_json_and_answer_in_binary(tiny_spec):
    dense, lengths, values = [[1, 2, 3, 4], [5, 6, 7, 8]], [[2, 1], [0, 0], [0, 0], [1, 0], [0, 1]], [5, 6, 9, 7, 23]
    json_form = _decode(tiny_spec, _v2(dense, lengths, values))
    binary = _decode_binary(tiny_spec, _binary(dense, lengths, values))
    for name in (DENSE_INPUT, SPARSE_INPUT):
        assert str(binary.inputs.tensors[name]) == str(json_form.inputs.tensors[name])
    response = binary.encoder.answer(torch.tensor([0.0, 2.0]))
    assert response.content_type == "application/octet-stream"
    outputs = decode_response(response.body, int(response.headers["Inference-Header-Content-Length"]))
    assert outputs["scores"].tolist() == pytest.approx([0.5, 0.8807971])
    assert outputs["logits"].tolist() == [0.0, 2.0]


def test_binary_dense_features_are_read_in_place(tiny_spec):
    body = _binary([[1, 2, 3, 4]], [[1], [0], [0], [0], [0]], [7])
    dense = _decode_binary(tiny_spec, body).inputs.tensors[DENSE_INPUT]
    start = np.frombuffer(body.data, dtype=np.uint8).ctypes.data + body.json_length
    assert dense.data_ptr() == start, "float32 rows are a view into the request body, not a copy"


def _corrupt(body: BinaryBody, header=None, data=None, json_length=None):
    head = orjson.loads(bytes(body.data[: body.json_length]))
    if header:
        header(head)
    encoded = orjson.dumps(head)
    rest = bytes(body.data[body.json_length:])
    rest = data(rest) if data else rest
    return BinaryBody(encoded + rest, json_length if json_length is not None else len(encoded))


def _size(index, size):
    return lambda h: h["inputs"][index]["parameters"].update(binary_data_size=size)


BINARY_BAD_REQUESTS = [
    (dict(data=lambda rest: rest[:-4]), "inputs[2] (sparse_features.values).parameters.binary_data_size",
     "the body is shorter than the header says"),
    (dict(data=lambda rest: rest + b"\0" * 8), "body", "8 bytes after the binary tensors"),
    (dict(header=_size(0, 12), data=lambda rest: rest[4:]), "inputs[0] (dense_features).parameters.binary_data_size",
     "shape [1, 4] of FP32 needs 16 bytes, got 12"),
    (dict(header=lambda h: h["inputs"][1].update(datatype="FP32")), "inputs[1] (sparse_features.lengths).datatype",
     "must be one of"),
    (dict(header=lambda h: h["inputs"][2].update(shape=[2])), "inputs[2] (sparse_features.values).shape",
     "must be [1], got [2]"),
    (dict(data=lambda rest: rest[:16] + np.int64(3).tobytes() + rest[24:]),
     "inputs[2] (sparse_features.values).shape", "must be [3], got [1]"),  # lengths now add up to 3
    (dict(data=lambda rest: rest[:-8] + np.int64(5000).tobytes()),
     "inputs[2] (sparse_features.values) (feature user_id, item 0, id 0)", "outside the table's 1000 rows"),
    (dict(data=lambda rest: np.float32("nan").tobytes() + rest[4:]), "inputs[0] (dense_features).data[0]",
     "must be finite"),
    (dict(json_length=0), "Inference-Header-Content-Length", "must be the JSON header's length"),
    (dict(header=lambda h: h["inputs"][0].update(data=[1, 2, 3, 4])), "inputs[0] (dense_features).data",
     "a binary tensor (binary_data_size) has no data"),
]


@pytest.mark.parametrize("damage, field, problem", BINARY_BAD_REQUESTS)
def test_bad_binary_request_names_the_tensor(tiny_spec, damage, field, problem):
    body = _corrupt(_binary([[1, 2, 3, 4]], [[1], [0], [0], [0], [0]], [7]), **damage)
    with pytest.raises(BadRequest) as error:
        _decode_binary(tiny_spec, body)
    assert error.value.field == field and problem in error.value.message, error.value.message
    assert error.value.status == 400
