"""A TorchServe batch decoded together (the arrays of consecutive requests of one JSON form, items
or columnar, made at once) answers every request as that request decoded and scored alone: the
same scores, and the same refusals naming the same fields, whatever else shares its batch."""

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from archive_tools.client import ScoringClient
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema
from handlers.runtime.batching import coalesce
from handlers.runtime.inputs import JaggedIds
from handlers.runtime.wire.messages import JSON, BinaryBody
from handlers.runtime.wire.v2_tensors import decode_response, encode_request
from tests.helpers import items_request

MAX_ITEMS = (4, 9, 4096)  # items per forward (and per request): parts split, and not


def _limited(spec, max_items):
    per_request = min(max_items, spec.limits.max_items_per_request)
    limits = {"max_items_per_forward": max_items, "max_items_per_request": per_request}
    return spec.replace(limits=spec.limits.model_copy(update=limits))


def columnar_request(schema, request, flat):
    """An items-form request in TorchRec's columnar form (as TorchServe's DLRM example sends it):
    dense rows (or ``flat``), lengths and ids feature-major, weights where a bag has them."""
    items = request["items"]
    bags = [[item.get("sparse", {}).get(f, []) for item in items] for f in schema.feature_names]
    ids = [bag["ids"] if isinstance(bag, dict) else bag for feature in bags for bag in feature]
    body = {key: value for key, value in request.items() if key != "items"}
    body["float_features"] = [x for item in items for x in item["dense"]] if flat else [item["dense"] for item in items]
    body["id_list_features.lengths"] = [len(bag) for bag in ids]
    body["id_list_features.values"] = [i for bag in ids for i in bag]
    if any(isinstance(bag, dict) for feature in bags for bag in feature):
        body["id_list_features.weights"] = [
            w for feature in bags for bag in feature
            for w in (bag["weights"] if isinstance(bag, dict) else [1.0] * len(bag))
        ]
    return body


def _pool(spec):
    """Good requests of 1 to 4 items in every wire form, and refusals of every stage."""
    schema = input_schema(spec)
    good = [items_request(spec, n, seed=n, max_bag=3) for n in (1, 2, 3, 4)]
    item = good[0]["items"][0]
    bad_id = {**good[1], "items": [good[1]["items"][0], {**item, "sparse": {spec.feature_names[0]: [10**9]}}]}
    negative = {**good[0], "items": [{**item, "sparse": {spec.feature_names[-1]: [-1]}}]}
    bad_dense = {**good[0], "items": [{**item, "dense": ["x"] * spec.dense_features}]}
    short_dense = {**good[1], "items": [item, {**item, "dense": [1.0]}]}
    unknown = {**good[0], "items": [{**item, "sparse": {"nope": [1]}}]}
    client = ScoringClient(schema.model, schema, rest_url="http://127.0.0.1")
    tensors = BinaryBody(*encode_request(client.tensors(good[2]["items"], good[2].get("context"))))
    columnar = [columnar_request(schema, request, flat=n % 2 == 0) for n, request in enumerate(good)]
    bad_columnar_id = {**columnar[1], "id_list_features.values": [10**9] * len(columnar[1]["id_list_features.values"])}
    unmatched = {**columnar[2], "id_list_features.values": columnar[2]["id_list_features.values"] + [0]}
    negative_length = {**columnar[0], "id_list_features.lengths": [-1] + columnar[0]["id_list_features.lengths"][1:]}
    bad_columnar_dense = {**columnar[0], "float_features": ["x"] * spec.dense_features}
    pool = [*good, bad_id, negative, bad_dense, short_dense, unknown, b"{", tensors, orjson.dumps(good[3]),
            *columnar, *columnar, bad_columnar_id, unmatched, negative_length, bad_columnar_dense]
    if schema.context is not None:
        pool.append({"items": good[1]["items"]})  # no context row
        pool.append({**good[1], "context": [float("inf")] * schema.context_features})
    return pool


@pytest.fixture(scope="module")
def services(tiny_spec, tiny_weights, ranker_spec, ranker_weights):
    """(DLRM, the context ranker with weighted ids) x each forward cap: a service and its pool."""
    built = {}
    for spec, weights in ((tiny_spec, tiny_weights), (ranker_spec, ranker_weights)):
        for max_items in MAX_ITEMS:
            limited = _limited(spec, max_items)
            service = eager_service(limited, DLRMFactory(limited).inference_model(weights))
            built[spec.name, max_items] = (service, _pool(spec))
    return built


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.integers(0, 100), min_size=1, max_size=12), max_items=st.sampled_from(MAX_ITEMS))
def test_a_batch_answers_each_request_as_alone(services, picks, max_items):
    for (name, cap), (service, pool) in services.items():
        if cap != max_items:
            continue
        batch = [pool[i % len(pool)] for i in picks]
        together = service.handle(batch).responses
        alone = [service.handle([request]).responses[0] for request in batch]
        assert [r.status for r in together] == [r.status for r in alone], name
        for got, want in zip(together, alone):
            if want.status != 200:
                assert got.body == want.body  # the same refusal, naming the same field
            else:
                torch.testing.assert_close(_scores(got), _scores(want), atol=1e-6, rtol=0)


def _scores(response):
    """The scores of a JSON answer or of a KServe v2 binary one."""
    if response.content_type == JSON:
        return torch.tensor(orjson.loads(response.body)["scores"])
    (scores,) = decode_response(response.body).values()
    return torch.from_numpy(scores)


def _assert_laid_out_as_coalesced(part, alone: list, schema) -> None:
    """``part``'s tensors are exactly the requests' decoded ``alone`` and coalesced."""
    reference = coalesce(alone, schema.tags)
    together = coalesce([part.inputs], schema.tags)
    for name, want in reference.items():
        got = together[name]
        if isinstance(want, JaggedIds):
            assert torch.equal(got.lengths, want.lengths) and torch.equal(got.values, want.values)
            assert torch.equal(got.weights, want.weights)
        else:
            assert torch.equal(got, want), name


def test_consecutive_items_requests_become_one_part_laid_out_as_coalesced(ranker_spec):
    """Three items-form requests decode to one part whose tensors are exactly the three requests
    decoded alone and coalesced; a v2 body between them splits the run."""
    schema = input_schema(ranker_spec)
    service_decoder = eager_service(ranker_spec, torch.nn.Identity()).decoder
    requests = [items_request(ranker_spec, n, seed=n, max_bag=4) for n in (3, 1, 2)]
    batch = service_decoder.decode_batch(requests, max_items=4096)
    assert not batch.refused and len(batch.parts) == 1
    (part,) = batch.parts
    assert part.positions == [0, 1, 2] and part.inputs.counts == (3, 1, 2)
    _assert_laid_out_as_coalesced(part, [service_decoder.decode(r).inputs for r in requests], schema)

    client = ScoringClient(schema.model, schema, rest_url="http://127.0.0.1")
    tensors = BinaryBody(*encode_request(client.tensors(requests[1]["items"], requests[1]["context"])))
    split = service_decoder.decode_batch([requests[0], tensors, requests[2]], max_items=4096)
    assert [p.positions for p in split.parts] == [[0], [1], [2]]


def test_consecutive_columnar_requests_become_one_part_laid_out_as_coalesced(ranker_spec):
    """Columnar requests of 3, 1 and 2 items (rows, flat, rows; weights given and left out) decode
    to one part whose tensors are exactly the three requests decoded alone and coalesced; an
    items-form request between them splits the run."""
    schema = input_schema(ranker_spec)
    decoder = eager_service(ranker_spec, torch.nn.Identity()).decoder
    sent = [items_request(ranker_spec, n, seed=10 + n, max_bag=4) for n in (3, 1, 2)]
    requests = [columnar_request(schema, r, flat=k == 1) for k, r in enumerate(sent)]
    assert any("id_list_features.weights" in r for r in requests)
    requests[2].pop("id_list_features.weights", None)
    batch = decoder.decode_batch(requests, max_items=4096)
    assert not batch.refused and len(batch.parts) == 1
    (part,) = batch.parts
    assert part.positions == [0, 1, 2] and part.inputs.counts == (3, 1, 2)
    _assert_laid_out_as_coalesced(part, [decoder.decode(r).inputs for r in requests], schema)
    split = decoder.decode_batch([requests[0], sent[1], requests[2]], max_items=4096)
    assert [p.positions for p in split.parts] == [[0], [1], [2]]
