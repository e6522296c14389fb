"""Per-request sequences (the DIN example's history): the JSON items form, the columnar form and
KServe v2 tensors (JSON and binary) decode to the same inputs; a request's ids keep their order;
several requests coalesce per request; every problem is a 4xx naming the feature."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import torch

from archive_tools.client import ScoringClient
from handlers.modeling.registry import input_schema, load_spec
from handlers.runtime.batching import coalesce
from handlers.runtime.errors import BadRequest
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.messages import BinaryBody, Rejected
from handlers.runtime.wire.v2_tensors import encode_request

from din_ranker.data import user_request  # isort: skip
from din_ranker.train import SPEC  # isort: skip

SCHEMA = input_schema(load_spec(SPEC))
HISTORY = SCHEMA.context_jagged.name


def _decode(payload):
    try:
        return RequestDecoder(SCHEMA).decode(payload if not isinstance(payload, dict) else orjson.dumps(payload))
    except Rejected as refusal:
        raise refusal.error from None


def _request(history: int, candidates: int = 3, seed: int = 0) -> dict:
    return user_request(np.random.default_rng(seed), history, candidates)[0]


def _columnar(request: dict) -> dict:
    items = request["items"]
    features = SCHEMA.feature_names
    bags = [item["sparse"].get(f, []) for f in features for item in items]
    return {
        "float_features": [item["dense"] for item in items],
        "id_list_features.lengths": [len(b) for b in bags],
        "id_list_features.values": [i for b in bags for i in b],
        "context_sparse": request["context_sparse"],
    }


def _v2(request: dict, binary: bool):
    client = ScoringClient("din", SCHEMA, rest_url="http://127.0.0.1")
    tensors = client.tensors(request["items"], None, request["context_sparse"])
    if binary:
        body, length = encode_request(tensors)
        return BinaryBody(body, length)
    inputs = [
        {"name": name, "datatype": "FP32" if array.dtype == np.float32 else "INT64", "shape": list(array.shape),
         "data": array.reshape(-1).tolist()}
        for name, array in tensors.items()
    ]
    return orjson.dumps({"inputs": inputs})


@pytest.mark.parametrize("form", ["columnar", "v2_json", "v2_binary"])
def test_every_form_decodes_the_history_like_the_items_form(form):
    request = _request(history=7)
    expected = _decode(request).inputs.tensors
    payload = {"columnar": lambda: orjson.dumps(_columnar(request)),
               "v2_json": lambda: _v2(request, binary=False), "v2_binary": lambda: _v2(request, binary=True)}[form]()
    got = _decode(payload).inputs.tensors
    assert torch.equal(got[HISTORY].lengths, torch.tensor([[7]]))
    assert got[HISTORY].values.tolist() == request["context_sparse"]["history"]  # in the order sent
    for name in expected:
        for field in ("lengths", "values") if name in (HISTORY, SCHEMA.jagged.name) else (None,):
            a, b = (getattr(t[name], field) if field else t[name] for t in (got, expected))
            assert torch.equal(a, b), (name, field)


def test_requests_coalesce_their_histories_per_request_and_an_empty_one_is_valid():
    requests = [_request(history=h, candidates=c, seed=h) for h, c in ((3, 2), (0, 4), (5, 1))]
    decoded = [_decode(r).inputs for r in requests]
    batch = coalesce(decoded, SCHEMA.tags)
    assert batch[HISTORY].lengths.tolist() == [[3, 0, 5]]
    assert batch[HISTORY].values.tolist() == requests[0]["context_sparse"]["history"] + requests[2]["context_sparse"]["history"]
    assert batch["item_counts"].tolist() == [2, 4, 1]
    together = RequestDecoder(SCHEMA).decode_batch([orjson.dumps(r) for r in requests], max_items=64)
    assert [p.positions for p in together.parts] == [[0, 1, 2]] and not together.refused
    assert torch.equal(together.parts[0].inputs.tensors[HISTORY].values, batch[HISTORY].values)
    assert together.parts[0].inputs.tensors[HISTORY].lengths.tolist() == [[3, 0, 5]]


BAD = [
    ({"context_sparse": {"history": list(range(501))}}, "context_sparse.history",
     "501 ids exceed the limit of 500 per sequence"),
    ({"context_sparse": {"history": [3, -1]}}, "context_sparse.history[1]", "ids must be >= 0, got -1"),
    ({"context_sparse": {"history": [3, 20_000]}}, "context_sparse.history[1]", "id 20000 is outside the table's 20000 rows"),
    ({"context_sparse": {"history": [3, 1.5]}}, "context_sparse.history[1]", "must be an integer id, got 1.5"),
    ({"context_sparse": {"history": "12"}}, "context_sparse.history", "must be a list of ids, got string"),
    ({"context_sparse": {"clicks": [1]}}, "context_sparse.clicks", "unknown feature"),
    ({"context_sparse": [1, 2]}, "context_sparse", "must be an object of feature: [ids], got array"),
]


@pytest.mark.parametrize("change, field, problem", BAD, ids=[b[1] + ":" + b[2][:12] for b in BAD])
def test_a_bad_history_is_a_400_naming_the_feature(change, field, problem):
    with pytest.raises(BadRequest) as refused:
        _decode({**_request(history=2), **change})
    assert refused.value.message == f"{field}: {problem}" and refused.value.field == field


def test_a_v2_history_over_its_limit_is_named_by_its_tensor():
    request = _request(history=501)
    with pytest.raises(BadRequest, match=r"inputs\[4\] \(history.values\) \(feature history\): 501 ids exceed the limit of 500 per sequence"):
        _decode(_v2(request, binary=True))


def test_a_candidate_sequence_is_capped_per_item_and_a_category_bag_per_bag():
    request = _request(history=1)
    request["items"][1]["sparse"]["candidate"] = list(range(501))
    with pytest.raises(BadRequest, match="501 ids exceed the limit of 500 per sequence"):
        _decode(request)
    request = _request(history=1)
    request["items"][0]["sparse"]["category"] = [1] * 257
    with pytest.raises(BadRequest, match="257 ids exceed the limit of 256 per bag"):
        _decode(request)


def test_a_history_given_twice_is_named_and_a_well_formed_body_skips_the_slow_check(monkeypatch):
    body = orjson.dumps(_request(history=2)).decode()
    twice = body.replace('"context_sparse":{"history":', '"context_sparse":{"history":[1],"history":')
    with pytest.raises(BadRequest, match="history: given twice in one JSON object"):
        _decode(twice.encode())

    def slow(*args, **kwargs):
        raise AssertionError("a body without repeated keys went through the slow duplicate-key parse")

    monkeypatch.setattr("handlers.runtime.wire.json_values.json.loads", slow)
    assert _decode(body.encode()).inputs.num_items == 3


def test_the_client_refuses_a_per_request_feature_the_model_does_not_take():
    client = ScoringClient("din", SCHEMA, rest_url="http://127.0.0.1")
    request = _request(history=2)
    with pytest.raises(ValueError, match=r"context_sparse: \['histroy'\] are not this model's per-request features \(history\)"):
        client.tensors(request["items"], None, {"histroy": [1, 2]})
