"""The coalescer: many requests in one forward score exactly as each request alone."""

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.runtime.batching import chunk_by_items, coalesce, padding_request
from handlers.runtime.inputs import BatchKind, InputTag, JaggedIds, RequestInputs
from tests.helpers import forward, items_request, model_inputs


@pytest.fixture(scope="module")
def served_models(tiny_spec, tiny_weights, ranker_spec, ranker_weights):
    return [
        (tiny_spec, DLRMFactory(tiny_spec).inference_model(tiny_weights)),
        (ranker_spec, DLRMFactory(ranker_spec).inference_model(ranker_weights)),
    ]


def _request(spec, draw_items, draw_bag, seed):
    return items_request(spec, draw_items, seed=seed, max_bag=draw_bag)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shapes=st.lists(
        st.tuples(st.integers(1, 200), st.integers(0, 50), st.integers(0, 10_000)),
        min_size=1,
        max_size=6,
    )
)
def test_coalesced_scores_equal_one_by_one(served_models, shapes):
    """DLRM (no context) and the context ranker (context once per request, weighted ids)."""
    for spec, model in served_models:
        requests = [_request(spec, n, bag, seed) for n, bag, seed in shapes]
        alone = [forward(model, spec, model_inputs(spec, [r])) for r in requests]
        together = forward(model, spec, model_inputs(spec, requests))
        assert together.shape[0] == sum(n for n, _, _ in shapes)
        torch.testing.assert_close(together, torch.cat(alone), atol=1e-6, rtol=0)


def test_service_answers_in_order_and_isolates_bad_requests(tiny_spec, tiny_weights):
    service = eager_service(tiny_spec, DLRMFactory(tiny_spec).inference_model(tiny_weights))
    good = [items_request(tiny_spec, n, seed=n) for n in (3, 1, 7)]
    alone = [service.handle([r]).responses[0] for r in good]
    mixed = service.handle([good[0], {"items": [{"dense": [1]}]}, good[1], b"{", good[2]]).responses
    assert [r.status for r in mixed] == [200, 400, 200, 400, 200]
    assert [mixed[i].body for i in (0, 2, 4)] == [a.body for a in alone]


def test_chunks_respect_max_items_and_order():
    requests = [RequestInputs(num_items=n, tensors={}) for n in (3, 4, 2, 5, 1)]
    assert list(chunk_by_items(requests, 7)) == [[0, 1], [2, 3], [4]]
    assert list(chunk_by_items(requests, 5)) == [[0], [1], [2], [3], [4]]
    assert list(chunk_by_items(requests, 100)) == [[0, 1, 2, 3, 4]]


def test_service_chunks_forwards_at_max_items(tiny_spec, tiny_weights):
    spec = tiny_spec.replace(limits=tiny_spec.limits.model_copy(update={"max_items_per_forward": 256}))
    model = DLRMFactory(spec).inference_model(tiny_weights)
    batch_sizes = []
    original = model.forward

    def counting_forward(dense_features, sparse_features):
        batch_sizes.append(dense_features.shape[0])
        return original(dense_features, sparse_features)

    model.forward = counting_forward
    service = eager_service(spec, model)
    requests = [items_request(spec, n, seed=n) for n in (200, 100, 50, 256)]
    handled = service.handle(requests)
    assert batch_sizes == [200, 150, 256]
    assert handled.stats.forward_items == [200, 150, 256]
    assert all(r.status == 200 for r in handled.responses)


def _two_requests():
    """Requests of 2 and 3 candidates, each with its own user context row."""
    return [
        RequestInputs(2, {"candidates": torch.tensor([[1.0], [2.0]]), "user": torch.tensor([[10.0, 11.0]])}),
        RequestInputs(3, {"candidates": torch.tensor([[3.0], [4.0], [5.0]]), "user": torch.tensor([[20.0, 21.0]])}),
    ]


def test_context_kept_per_request_with_item_counts():
    """The model gets one context row per request and the item counts (it spreads the rows)."""
    tags = (
        InputTag("user", BatchKind.CONTEXT),
        InputTag("counts", BatchKind.ITEM_COUNTS),
        InputTag("candidates", BatchKind.ROWS),
    )
    batch = coalesce(_two_requests(), tags)
    assert batch["user"].tolist() == [[10, 11], [20, 21]]
    assert batch["counts"].tolist() == [2, 3] and batch["counts"].dtype == torch.int64


def test_jagged_weights_follow_their_ids():
    tags = (InputTag("ids", BatchKind.JAGGED, keys=("a", "b")),)
    requests = [
        RequestInputs(1, {"ids": JaggedIds(torch.tensor([[2], [1]]), torch.tensor([1, 2, 3]), torch.tensor([0.1, 0.2, 0.3]))}),
        RequestInputs(2, {"ids": JaggedIds(torch.tensor([[1, 0], [0, 1]]), torch.tensor([4, 5]), torch.tensor([0.4, 0.5]))}),
    ]
    ids = coalesce(requests, tags)["ids"]
    assert ids.lengths.tolist() == [[2, 1, 0], [1, 0, 1]]  # [features, items]
    assert ids.values.tolist() == [1, 2, 4, 3, 5]
    torch.testing.assert_close(ids.weights, torch.tensor([0.1, 0.2, 0.4, 0.3, 0.5]))


def test_failed_forward_is_a_500_for_its_chunk_only(tiny_spec, tiny_weights):
    """A model failure on validated input is our bug: 500 for that chunk, the next chunk is served."""
    spec = tiny_spec.replace(limits=tiny_spec.limits.model_copy(update={"max_items_per_forward": 256}))
    model = DLRMFactory(spec).inference_model(tiny_weights)
    original = model.forward
    calls = []

    def fails_first(dense_features, sparse_features):
        calls.append(dense_features.shape[0])
        if len(calls) == 1:
            raise RuntimeError("kernel exploded")
        return original(dense_features, sparse_features)

    model.forward = fails_first
    service = eager_service(spec, model)
    responses = service.handle([items_request(spec, 200, seed=1), items_request(spec, 100, seed=2)]).responses
    assert [r.status for r in responses] == [500, 200]
    assert b"model forward failed" in responses[0].body
    assert len(orjson.loads(responses[1].body)["scores"]) == 100


def test_padding_request_is_one_empty_item_that_changes_no_score(served_models):
    for spec, model in served_models:
        service = eager_service(spec, model)
        request = service.decoder.decode(_request(spec, 5, 6, seed=9)).inputs
        pad = padding_request(request, service.schema)
        assert pad.num_items == 1
        for tag in service.tags:
            if tag.kind == BatchKind.JAGGED:
                ids = pad.tensors[tag.name]
                assert ids.lengths.tolist() == [[0]] * len(tag.keys) and ids.values.numel() == 0
                assert (ids.weights is None) == (request.tensors[tag.name].weights is None)
            elif tag.kind != BatchKind.ITEM_COUNTS:
                assert pad.tensors[tag.name].shape[0] == 1 and not pad.tensors[tag.name].any()
        alone = forward(model, spec, model_inputs(spec, [_request(spec, 5, 6, seed=9)]))
        padded = forward(model, spec, coalesce([request, pad], service.tags))
        assert padded.shape[0] == 6
        torch.testing.assert_close(padded[:5], alone, atol=1e-6, rtol=0)


def test_batch_stats_count_what_the_metrics_publish(tiny_spec, tiny_weights):
    """Per batch: time in each stage, refusals by reason, ids hashed by the ``hash`` policy."""
    from handlers.runtime.inputs import OutOfRangePolicy

    spec = tiny_spec.replace(out_of_range=OutOfRangePolicy.HASH)
    service = eager_service(spec, DLRMFactory(spec).inference_model(tiny_weights))
    hashed = {"items": [{"dense": [0] * 4, "sparse": {"hour": [24, 49, 3], "user_id": [1000]}}]}
    handled = service.handle([
        items_request(spec, 3, seed=1),
        b"{not json",
        {"items": [{"dense": [0] * 4, "colour": 1}]},
        {"items": [{"dense": [0] * 4, "sparse": {"hour": [-1]}}]},
        hashed,
    ])
    assert [r.status for r in handled.responses] == [200, 400, 400, 400, 200]
    stats = handled.stats
    assert stats.rejected == {"malformed_body": 1, "unknown_field": 1, "id_out_of_range": 1}
    assert stats.hashed_ids == 3  # 24 and 49 of 24 hours, 1000 of 1000 users
    assert stats.forward_items == [4]
    assert set(stats.stage_ms) == {"decode", "coalesce", "forward", "encode"}
    assert all(ms > 0 for ms in stats.stage_ms.values()), stats.stage_ms
