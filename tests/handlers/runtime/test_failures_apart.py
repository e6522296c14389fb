"""Models that take exactly one id of a feature, and failures that stay with their request.

The model here is the DIN example's ranker made strict, as a user's own model may be: it reads a
candidate's and a category's id by position (``ids.view(N)``), so a forward fails unless every
item holds exactly one of each. The spec says so (``ids_per_feature: {candidate: {min: 1, max: 1},
...}``): requests are
held to it, the padding items keep to it, and a request the model still refuses fails alone while
its batch neighbours get the scores they get alone.
"""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import torch

from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema, load_spec, synthetic_request
from handlers.modeling.spec import IdsPerItem
from handlers.runtime.batching import padding_request
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.messages import Rejected

from din_ranker.data import user_request  # isort: skip
from din_ranker.train import SPEC as DIN_SPEC  # isort: skip

ONE = IdsPerItem(min=1, max=1)
TOLERANCE = 1e-6  # the same float model, the same items, batched or alone: equal but for summation order


def _spec(**ids_per_feature: IdsPerItem):
    spec = load_spec(DIN_SPEC)
    tables = [
        t.model_copy(update={"ids_per_feature": {f: c for f, c in ids_per_feature.items() if f in t.features}})
        for t in spec.tables
    ]
    return spec.replace(tables=tables)


def _strict(model):
    """``model`` taking exactly one candidate and one category id an item, as a model that reads
    them by position does: ``ids.view(N)`` raises on any other count."""
    forward = model.forward

    def one_id_each(dense, sparse, history, item_counts):
        for feature in ("candidate", "category"):
            sparse[feature].values().view(dense.shape[0])
        return forward(dense, sparse, history, item_counts)

    model.forward = one_id_each
    return model


@pytest.fixture(scope="module")
def strict_model():
    return _strict(DLRMFactory(_spec()).float_model(seed=0))


def _request(history: int, candidates: int, seed: int) -> dict:
    return user_request(np.random.default_rng(seed), history, candidates)[0]


def _scores(response) -> list[float]:
    assert response.status == 200, response.body
    return orjson.loads(response.body)["scores"]


def test_a_request_without_history_scores_alone_as_batched(strict_model):
    """Alone, a request whose history is empty is padded with an item holding a history id: that
    item's candidate and category bags hold one id each too, so the model sees one of each an item."""
    service = eager_service(_spec(candidate=ONE, category=ONE), strict_model)
    no_history, other = _request(0, 3, seed=1), _request(5, 4, seed=2)
    alone = _scores(service.handle([no_history]).responses[0])
    batched = service.handle([no_history, other]).responses
    assert len(alone) == 3
    np.testing.assert_allclose(_scores(batched[0]), alone, atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(_scores(batched[1]), _scores(service.handle([other]).responses[0]), atol=TOLERANCE, rtol=0)


def test_padding_items_hold_each_features_fewest_ids():
    spec = _spec(candidate=ONE, category=IdsPerItem(min=2))
    schema = input_schema(spec)
    like = RequestDecoder(schema).decode(orjson.dumps(synthetic_request(spec, 2, seed=0))).inputs
    pad = padding_request(like, schema)
    assert pad.tensors[schema.jagged.name].lengths.tolist() == [[1], [2]]  # candidate, category
    assert pad.tensors[schema.context_jagged.name].lengths.tolist() == [[0]]  # history: min 0
    with_ids = padding_request(like, schema, with_ids=True)
    assert with_ids.tensors[schema.context_jagged.name].lengths.tolist() == [[1]]
    assert with_ids.tensors[schema.jagged.name].lengths.tolist() == [[1], [2]]
    lenient = input_schema(_spec(category=IdsPerItem(min=2)))  # the first bag gets an id, min 0 or not
    assert padding_request(like, lenient, with_ids=True).tensors[schema.jagged.name].lengths.tolist() == [[1], [2]]


def test_synthetic_requests_keep_to_the_spec_counts():
    spec = _spec(candidate=ONE, history=IdsPerItem(min=2, max=3))
    for seed in range(5):
        request = synthetic_request(spec, 16, seed=seed, max_bag=4)
        assert all(len(item["sparse"]["candidate"]) == 1 for item in request["items"])
        assert 2 <= len(request["context_sparse"]["history"]) <= 3
        RequestDecoder(input_schema(spec)).decode(orjson.dumps(request))  # the decoder takes it


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        (lambda r: r["items"][1]["sparse"].pop("candidate"), "items[1].sparse.candidate", "at least 1 id"),
        (lambda r: r["items"][2]["sparse"]["candidate"].append(7), "items[2].sparse.candidate", "limit of 1"),
        (lambda r: r.pop("context_sparse"), "context_sparse.history", "at least 1 id"),
    ],
)
def test_the_decoder_holds_requests_to_the_spec_counts(change, field, problem):
    schema = input_schema(_spec(candidate=ONE, history=IdsPerItem(min=1)))
    request = _request(4, 3, seed=3)
    change(request)
    with pytest.raises(Rejected) as refused:
        RequestDecoder(schema).decode(orjson.dumps(request))
    assert refused.value.error.status == 400
    assert refused.value.error.field == field and problem in refused.value.error.message


def test_a_request_the_model_refuses_fails_alone(strict_model):
    """The spec says nothing of the category's ids, so the decoder lets two through: the model
    raises, the batch is split, and only the requests that fail alone get an error (a 400 naming
    the model's error); the others get the scores they get alone."""
    service = eager_service(_spec(), strict_model)
    requests = [_request(3, 2 + k % 3, seed=10 + k) for k in range(8)]
    for bad in (2, 5):
        requests[bad]["items"][0]["sparse"]["category"] = [4, 9]
    handled = service.handle(requests)
    statuses = [r.status for r in handled.responses]
    assert statuses == [200, 200, 400, 200, 200, 400, 200, 200]
    for bad in (2, 5):
        body = orjson.loads(handled.responses[bad].body)
        assert body["field"] == "request" and "RuntimeError: shape" in body["message"], body
    for k in (0, 1, 3, 4, 6, 7):
        alone = _scores(service.handle([requests[k]]).responses[0])
        np.testing.assert_allclose(_scores(handled.responses[k]), alone, atol=TOLERANCE, rtol=0)
    assert handled.stats.split_forwards == 1
    assert handled.stats.rejected == {"model_refused": 2}


def _failing_on_a_marker(marker: float):
    """The float model raising an error that names no shape or value on any item whose first
    dense feature is ``marker`` (as a compiled graph's errors do: AOTInductor's name its runner)."""
    model = DLRMFactory(_spec()).float_model(seed=0)
    forward = model.forward

    def fails_on_a_marker(dense, sparse, history, item_counts):
        if bool((dense[:, 0] == marker).any()):
            raise RuntimeError("run_func_(container_handle_, ...) API call failed")
        return forward(dense, sparse, history, item_counts)

    model.forward = fails_on_a_marker
    return model


def test_an_error_that_says_nothing_is_the_requests_where_its_neighbours_were_scored():
    """The neighbours are the evidence: scored while it fails alone, the request is to blame (400
    naming the model's error); alone in its batch, or failing beside requests that all fail, the
    server is (500, the message generic, the traceback to the log)."""
    service = eager_service(_spec(), _failing_on_a_marker(123.0))
    requests = [_request(2, 3, seed=20 + k) for k in range(4)]
    requests[1]["items"][2]["dense"][0] = 123.0
    handled = service.handle(requests)
    assert [r.status for r in handled.responses] == [200, 400, 200, 200]
    assert "API call failed" in orjson.loads(handled.responses[1].body)["message"]
    assert handled.stats.split_forwards == 1 and handled.stats.rejected == {"model_refused": 1}
    torch.testing.assert_close(
        torch.tensor(_scores(handled.responses[3])), torch.tensor(_scores(service.handle([requests[3]]).responses[0]))
    )
    alone = service.handle([requests[1]]).responses[0]
    assert alone.status == 500 and orjson.loads(alone.body)["message"] == "model forward failed"
    for request in requests[2:]:
        request["items"][0]["dense"][0] = 123.0
    all_fail = service.handle(requests[1:])
    assert [r.status for r in all_fail.responses] == [500, 500, 500] and all_fail.stats.rejected == {}
