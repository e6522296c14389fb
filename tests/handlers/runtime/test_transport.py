"""A request as it arrived: size limit, gzip, forms and other encodings, repeated JSON keys."""

import gzip
import json

import pytest

from handlers.modeling.registry import input_schema
from handlers.runtime.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from handlers.runtime.inputs import JaggedIds
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.json_values import refuse_duplicate_keys
from handlers.runtime.wire.messages import Rejected
from handlers.runtime.wire.transport import Arrival, opened
from tests.handlers.runtime.test_decode_v2 import _v2 as v2_body

ITEM = {"dense": [0.1, 0.2, 0.3, 0.4], "sparse": {"user_id": [1, 2], "item_id": [3]}}
BODY = json.dumps({"items": [ITEM, ITEM]}).encode()


def _refusal(spec, arrival: Arrival) -> BadRequest:
    with pytest.raises(Rejected) as refusal:
        RequestDecoder(input_schema(spec)).decode(arrival)
    return refusal.value.error


def test_gzip_body_decodes_like_the_plain_one(tiny_spec):
    decoder = RequestDecoder(input_schema(tiny_spec))
    plain = decoder.decode(Arrival(BODY, "application/json"))
    zipped = decoder.decode(Arrival(gzip.compress(BODY), "application/json", content_encoding="gzip"))
    assert plain.inputs.num_items == zipped.inputs.num_items == 2
    for name, tensor in plain.inputs.tensors.items():
        other = zipped.inputs.tensors[name]
        if isinstance(tensor, JaggedIds):
            assert tensor.lengths.equal(other.lengths) and tensor.values.equal(other.values), name
        else:
            assert tensor.equal(other), name


def test_body_over_the_limit_is_a_413_naming_the_limit():
    with pytest.raises(PayloadTooLarge) as refusal:
        opened(Arrival(b"x" * 101), max_bytes=100)
    assert refusal.value.status == 413 and "limits.max_request_bytes" in refusal.value.message


def test_gzip_bomb_is_stopped_at_the_limit():
    bomb = gzip.compress(b" " * (50 << 20))  # 50 MiB of spaces in ~50 KiB
    assert len(bomb) < 100_000
    with pytest.raises(PayloadTooLarge, match="once gzip-decoded"):
        opened(Arrival(bomb, content_encoding="gzip"), max_bytes=1 << 20)


@pytest.mark.parametrize(
    "data, problem",
    [(b"not gzip", "not valid gzip"), (gzip.compress(BODY, mtime=0)[:-12], "ends early")],
    ids=["not-gzip", "cut-short"],
)
def test_broken_gzip_is_a_400_naming_the_encoding(data, problem):
    with pytest.raises(BadRequest) as refusal:
        opened(Arrival(data, content_encoding="gzip"), max_bytes=1 << 20)
    assert refusal.value.status == 400 and refusal.value.field == "Content-Encoding"
    assert problem in refusal.value.message


def test_other_encodings_are_a_415(tiny_spec):
    error = _refusal(tiny_spec, Arrival(BODY, "application/json", content_encoding="br"))
    assert isinstance(error, UnsupportedMediaType) and error.status == 415
    assert error.field == "Content-Encoding" and "'br'" in error.message


@pytest.mark.parametrize("encoding", ["identity", " Identity ", ""])
def test_identity_and_an_empty_encoding_leave_the_body_as_sent(encoding):
    assert opened(Arrival(BODY, "application/json", content_encoding=encoding), max_bytes=1 << 20) == BODY


def test_a_form_body_is_a_415_with_the_fix(tiny_spec):
    """curl -d sends a form; TorchServe then hands over its fields, not the body."""
    error = _refusal(tiny_spec, Arrival(None, "application/x-www-form-urlencoded"))
    assert error.status == 415 and "Content-Type: application/json" in error.message


@pytest.mark.parametrize(
    "body, key",
    [
        (b'{"items": [], "items": [{"dense": [1, 2, 3, 4]}]}', "items"),
        (b'{"items": [{"dense": [1, 2, 3, 4], "dense": [5, 6, 7, 8], "sparse": {}}]}', "dense"),
        (b'{"items": [{"dense": [1, 2, 3, 4], "sparse": {"user_id": [1], "user_id": [2]}}]}', "user_id"),
    ],
)
def test_a_key_given_twice_is_refused_by_name(tiny_spec, body, key):
    error = _refusal(tiny_spec, Arrival(body, "application/json"))
    assert error.status == 400 and error.field == key and "twice" in error.message


def test_colons_inside_strings_are_not_mistaken_for_keys():
    refuse_duplicate_keys(b'{"a": "x:y:z", "b": 1}', keys=2)  # no error
    with pytest.raises(BadRequest):
        refuse_duplicate_keys(b'{"a": "x:y", "a": 1}', keys=1)


def test_kserve_v2_duplicate_keys_are_refused(tiny_spec):
    """Even when each copy alone is a valid request."""
    body = v2_body([[1, 2, 3, 4]], [[1], [0], [0], [0], [0]], [7])
    text = json.dumps(body)[:-1] + f', "inputs": {json.dumps(body["inputs"])}}}'
    error = _refusal(tiny_spec, Arrival(text.encode(), "application/json"))
    assert error.field == "inputs" and "twice" in error.message
