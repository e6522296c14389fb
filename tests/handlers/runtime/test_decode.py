"""The wire formats: the items form, TorchRec's columnar form (as TorchServe's DLRM example sends
it) and KServe v2 decode to the same tensors, and every bad request is a 400 naming the field."""

import json

import numpy as np
import orjson
import pytest
import torch

from handlers.modeling.architecture import CONTEXT_INPUT, DENSE_INPUT, SPARSE_INPUT
from handlers.modeling.registry import input_schema
from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import OutOfRangePolicy
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.messages import BinaryBody, JsonEncoder, Rejected
from handlers.runtime.wire.v2_tensors import decode_response, encode_request

GOOD_ITEM = {"dense": [0.1, 0.2, 0.3, 0.4], "sparse": {"user_id": [1, 2], "item_id": [3]}}


def _decode(spec, body):
    """Decodes ``body`` (sent as JSON bytes); a refusal raises its ``BadRequest``."""
    return _decode_payload(spec, body if isinstance(body, bytes) else json.dumps(body).encode())


def _decode_payload(spec, payload):
    try:
        return RequestDecoder(input_schema(spec)).decode(payload)
    except Rejected as refusal:
        raise refusal.error from None


def _with_item(**fields):
    return {"items": [GOOD_ITEM, {**GOOD_ITEM, **fields}]}


def test_items_form_is_laid_out_feature_major(tiny_spec):
    body = {
        "items": [
            {"dense": [1, 2, 3, 4], "sparse": {"user_id": [5, 6], "category": [7]}},
            {"dense": [5, 6, 7, 8], "sparse": {"user_id": [9], "hour": [23]}},
        ]
    }
    request = _decode(tiny_spec, body)
    jagged = request.inputs.tensors[SPARSE_INPUT]
    # features: user_id, item_id, last_item_id, category, hour; columns: items
    assert jagged.lengths.tolist() == [[2, 1], [0, 0], [0, 0], [1, 0], [0, 1]]
    assert jagged.values.tolist() == [5, 6, 9, 7, 23]
    assert request.inputs.tensors[DENSE_INPUT].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert request.inputs.num_items == 2 and request.encoder == JsonEncoder()


def test_columnar_form_equals_items_form(tiny_spec):
    items = _decode(tiny_spec, {"items": [
        {"dense": [1, 2, 3, 4], "sparse": {"user_id": [5, 6], "category": [7]}},
        {"dense": [5, 6, 7, 8], "sparse": {"user_id": [9], "hour": [23]}},
    ]})
    columnar = _decode(tiny_spec, {
        "float_features": [[1, 2, 3, 4], [5, 6, 7, 8]],
        "id_list_features.lengths": [2, 1, 0, 0, 0, 0, 1, 0, 0, 1],
        "id_list_features.values": [5, 6, 9, 7, 23],
        "return_logits": True,
    })
    assert torch.equal(items.inputs.tensors[DENSE_INPUT], columnar.inputs.tensors[DENSE_INPUT])
    assert torch.equal(items.inputs.tensors[SPARSE_INPUT].values, columnar.inputs.tensors[SPARSE_INPUT].values)
    assert torch.equal(items.inputs.tensors[SPARSE_INPUT].lengths, columnar.inputs.tensors[SPARSE_INPUT].lengths)
    assert columnar.encoder == JsonEncoder(return_logits=True, default=True)


def test_hash_policy_wraps_ids_modulo_rows(tiny_spec):
    spec = tiny_spec.replace(out_of_range=OutOfRangePolicy.HASH)
    request = _decode(spec, {"items": [{"dense": [0, 0, 0, 0], "sparse": {"hour": [24, 49, 3]}}]})
    assert request.inputs.tensors[SPARSE_INPUT].values.tolist() == [0, 1, 3]


BAD_REQUESTS = [
    (b'{"items": [', "body", "malformed JSON"),
    (b'{"items": [{"dense": [NaN, 1, 2, 3]}]}', "body", "malformed JSON"),
    (b"", "body", "malformed JSON"),
    (b"[1, 2]", "body", "must be a JSON object, got array"),
    ({"items": []}, "items", "non-empty list"),
    ({"items": "x"}, "items", "non-empty list"),
    ({}, "items", "required"),
    ({"items": [GOOD_ITEM], "colour": 1}, "colour", "unknown field"),
    ({"items": [GOOD_ITEM], "return_logits": "yes"}, "return_logits", "true or false"),
    ({"items": [GOOD_ITEM, 7]}, "items[1]", "must be an object, got number"),
    (_with_item(extra=1), "items[1].extra", "unknown field"),
    ({"items": [{"sparse": {}}]}, "items[0].dense", "required"),
    (_with_item(dense=[1, 2, 3]), "items[1].dense", "must hold 4 numbers, got 3"),
    (_with_item(dense="1,2,3,4"), "items[1].dense", "must be a list of 4 numbers"),
    (_with_item(dense=[1, 2, "3", 4]), "items[1].dense[2]", "must be a number, got '3'"),
    (_with_item(dense=[1, 2, True, 4]), "items[1].dense[2]", "must be a number, got True"),
    (_with_item(dense=[1, 2, None, 4]), "items[1].dense[2]", "must be a number"),
    (_with_item(dense=[1, 2, 1e39, 4]), "items[1].dense[2]", "must be finite in float32"),
    (_with_item(dense=[1, 2, 10**400, 4]), "body", "malformed JSON: number is infinity"),
    (_with_item(sparse=[1]), "items[1].sparse", "must be an object, got array"),
    (_with_item(sparse={"colour": [1]}), "items[1].sparse.colour", "unknown feature"),
    (_with_item(sparse={"user_id": 5}), "items[1].sparse.user_id", "must be a list of ids, got number"),
    (_with_item(sparse={"user_id": [1, 2.5]}), "items[1].sparse.user_id[1]", "must be an integer id, got 2.5"),
    (_with_item(sparse={"user_id": [1, "2"]}), "items[1].sparse.user_id[1]", "must be an integer id"),
    (_with_item(sparse={"user_id": [True]}), "items[1].sparse.user_id[0]", "must be an integer id, got True"),
    (_with_item(sparse={"item_id": [3, -1]}), "items[1].sparse.item_id[1]", "ids must be >= 0, got -1"),
    (_with_item(sparse={"hour": [23, 24]}), "items[1].sparse.hour[1]", "id 24 is outside the table's 24 rows"),
    # orjson reads integers beyond 64 bits as floats
    (_with_item(sparse={"user_id": [2**70]}), "items[1].sparse.user_id[0]", "must be an integer id"),
    (_with_item(sparse={"user_id": list(range(65))}), "items[1].sparse.user_id", "65 ids exceed the limit of 64"),
    ({"items": [GOOD_ITEM] * 257}, "items", "257 items exceed the limit of 256"),
    ({"float_features": [[1, 2, 3, 4]], "id_list_features.lengths": [1, 0, 0, 0],
      "id_list_features.values": [1]}, "id_list_features.lengths", "must hold 5 features x 1 items"),
    ({"float_features": [[1, 2, 3, 4]], "id_list_features.lengths": [1, 0, 0, 0, 0],
      "id_list_features.values": [1, 2]}, "id_list_features.values", "lengths add up to 1 ids, got 2"),
    ({"float_features": [[1, 2, 3, 4]], "id_list_features.lengths": [0, 0, 0, -1, 1],
      "id_list_features.values": []}, "id_list_features.lengths[3]", "must be >= 0"),
    ({"float_features": [[1, 2, 3, 4]], "id_list_features.lengths": [0, 0, 0, 0, 1],
      "id_list_features.values": [99]}, "id_list_features.values (feature hour, item 0, id 0)", "outside"),
    ({"float_features": [[1, 2, 3, 4]]}, "id_list_features.lengths", "required list, got null"),
]


@pytest.mark.parametrize("body, field, problem", BAD_REQUESTS)
def test_bad_request_names_the_field(tiny_spec, body, field, problem):
    with pytest.raises(BadRequest) as error:
        _decode(tiny_spec, body)
    assert error.value.field == field
    assert problem in error.value.message
    assert error.value.to_body()["field"] == field


def test_already_decoded_payload_with_nan_is_rejected(tiny_spec):
    """TorchServe's own JSON decoding (decode_input_request=true) lets NaN through; we do not."""
    with pytest.raises(BadRequest, match="must be finite"):
        _decode_payload(tiny_spec, {"items": [{"dense": [1.0, float("nan"), 0.0, 0.0]}]})


@pytest.mark.parametrize(
    "item, field, problem",
    [
        ({"dense": [1, 10**400, 0, 0]}, "items[0].dense[1]", "must be finite in float32"),
        ({"dense": [0] * 4, "sparse": {"user_id": [2**70]}}, "items[0].sparse.user_id[0]", "out of int64 range"),
    ],
)
def test_already_decoded_huge_integers_are_rejected(tiny_spec, item, field, problem):
    with pytest.raises(BadRequest) as error:
        _decode_payload(tiny_spec, {"items": [item]})
    assert error.value.field == field and problem in error.value.message


# -- the context ranker: a request-level context row and per-id weights ------------------------

RANKER_ITEM = {"dense": [0.1, 0.2, 0.3], "sparse": {"item_id": [7], "item_tags": {"ids": [1, 2], "weights": [0.5, 2]}}}
CONTEXT = [0.5] * 8


def test_ranker_request_carries_context_and_weights(ranker_spec):
    body = {"context": CONTEXT, "items": [RANKER_ITEM, {"dense": [1, 2, 3], "sparse": {"item_tags": [4]}}]}
    request = _decode(ranker_spec, body)
    assert request.inputs.num_items == 2
    assert request.inputs.tensors[CONTEXT_INPUT].shape == (1, 8)
    jagged = request.inputs.tensors[SPARSE_INPUT]
    # features: item_id, item_tags, seller; a plain list of ids has weights 1
    assert jagged.lengths.tolist() == [[1, 0], [2, 1], [0, 0]]
    assert jagged.values.tolist() == [7, 1, 2, 4]
    assert jagged.weights.tolist() == [1.0, 0.5, 2.0, 1.0]


def test_ranker_columnar_form_takes_context_and_optional_weights(ranker_spec):
    body = {
        "context": CONTEXT,
        "float_features": [[1, 2, 3]],
        "id_list_features.lengths": [1, 2, 0],
        "id_list_features.values": [7, 1, 2],
    }
    assert _decode(ranker_spec, body).inputs.tensors[SPARSE_INPUT].weights.tolist() == [1, 1, 1]
    body["id_list_features.weights"] = [1, 0.5, 2]
    assert _decode(ranker_spec, body).inputs.tensors[SPARSE_INPUT].weights.tolist() == [1, 0.5, 2]


def _ranker_item(**sparse):
    return {"context": CONTEXT, "items": [RANKER_ITEM, {"dense": [0, 0, 0], "sparse": sparse}]}


RANKER_BAD_REQUESTS = [
    ({"items": [RANKER_ITEM]}, "context", "required: a list of 8 numbers"),
    ({"context": [1.0] * 7, "items": [RANKER_ITEM]}, "context", "must hold 8 numbers, got 7"),
    ({"context": [1.0] * 7 + ["x"], "items": [RANKER_ITEM]}, "context[7]", "must be a number"),
    ({"context": 3, "items": [RANKER_ITEM]}, "context", "must be a list of 8 numbers"),
    (_ranker_item(item_tags={"ids": [1, 2], "weights": [1]}), "items[1].sparse.item_tags.weights", "one weight per id (2), got 1"),
    (_ranker_item(item_tags={"ids": [1], "weights": ["x"]}), "items[1].sparse.item_tags.weights[0]", "must be a number"),
    (_ranker_item(item_tags={"ids": [1, 2], "weights": [1, 1e39]}), "items[1].sparse.item_tags.weights[1]", "finite in float32"),
    (_ranker_item(item_tags={"ids": [1, 999]}), "items[1].sparse.item_tags.weights", "required list, got null"),
    (_ranker_item(item_tags={"ids": [1, 999], "weights": [1, 1]}), "items[1].sparse.item_tags.ids[1]", "outside the table's 300 rows"),
    (_ranker_item(item_tags={"ids": [1], "weights": [1], "bias": 2}), "items[1].sparse.item_tags.bias", "unknown field"),
    (_ranker_item(item_tags=3), "items[1].sparse.item_tags", 'a list of ids or {"ids"'),
    ({"context": CONTEXT, "float_features": [[1, 2, 3]], "id_list_features.lengths": [1, 0, 0],
      "id_list_features.values": [1], "id_list_features.weights": [1, 2]}, "id_list_features.weights", "one weight per value (1)"),
]


@pytest.mark.parametrize("body, field, problem", RANKER_BAD_REQUESTS)
def test_bad_ranker_request_names_the_field(ranker_spec, body, field, problem):
    with pytest.raises(BadRequest) as error:
        _decode(ranker_spec, body)
    assert error.value.field == field
    assert problem in error.value.message


def test_dlrm_refuses_context_and_weighted_bags(tiny_spec):
    with pytest.raises(BadRequest) as error:
        _decode(tiny_spec, {"context": [1.0], "items": [GOOD_ITEM]})
    assert error.value.field == "context" and "unknown field" in error.value.message
    with pytest.raises(BadRequest) as error:
        _decode(tiny_spec, _with_item(sparse={"user_id": {"ids": [1], "weights": [1]}}))
    assert error.value.field == "items[1].sparse.user_id"
    assert "must be a list of ids, got object" in error.value.message


# -- TorchServe's DLRM example's request shape: flat float_features --------------------------------


def test_flat_float_features_equal_rows(tiny_spec):
    rows = _decode(tiny_spec, {
        "float_features": [[1, 2, 3, 4], [5, 6, 7, 8]],
        "id_list_features.lengths": [2, 1, 0, 0, 0, 0, 1, 0, 0, 1],
        "id_list_features.values": [5, 6, 9, 7, 23],
    })
    flat = _decode(tiny_spec, {
        "float_features": [1, 2, 3, 4, 5, 6, 7, 8],
        "id_list_features.lengths": [2, 1, 0, 0, 0, 0, 1, 0, 0, 1],
        "id_list_features.values": [5, 6, 9, 7, 23],
    })
    for name in (DENSE_INPUT, SPARSE_INPUT):
        assert str(flat.inputs.tensors[name]) == str(rows.inputs.tensors[name])
    assert flat.encoder == JsonEncoder(default=True)


def test_torchserve_example_request_shape_is_accepted():
    """One item: 13 flat floats, 26 bags of one id each (Criteo 1TB ids; a 100k-row table hashes
    them), exactly as clients of TorchServe's DLRM example send it."""
    from handlers.modeling.registry import load_spec
    from tests.conftest import CRITEO_SPEC

    spec = load_spec(CRITEO_SPEC)
    body = {
        "float_features": [0.1 * k for k in range(13)],
        "id_list_features.lengths": [1] * 26,
        "id_list_features.values": [45_000_000 - 7 * k for k in range(26)],
    }
    decoded = _decode(spec, body)
    assert decoded.inputs.num_items == 1
    assert decoded.inputs.tensors[DENSE_INPUT].shape == (1, 13)
    assert decoded.hashed_ids == sum(v >= r for v, r in zip(body["id_list_features.values"], spec.feature_rows))


@pytest.mark.parametrize(
    "dense, problem",
    [([1, 2, 3], "a flat list must hold 4 numbers per item, got 3"), ([], "must be a non-empty list")],
)
def test_bad_flat_float_features_name_the_field(tiny_spec, dense, problem):
    body = {"float_features": dense, "id_list_features.lengths": [0] * 5, "id_list_features.values": []}
    with pytest.raises(BadRequest) as error:
        _decode(tiny_spec, body)
    assert error.value.field == "float_features" and problem in error.value.message


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
