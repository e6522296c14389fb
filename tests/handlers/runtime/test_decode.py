"""The wire formats: the items form, TorchRec's columnar form (as TorchServe's DLRM example sends
it) and KServe v2 decode to the same tensors, and every bad request is a 400 naming the field."""

import json

import pytest
import torch

from handlers.modeling.architecture import CONTEXT_INPUT, DENSE_INPUT, SPARSE_INPUT
from handlers.modeling.registry import input_schema
from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import OutOfRangePolicy
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.messages import JsonEncoder, Rejected

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
