"""A dense host's lookups on embedding shards, in process: each shard loaded as its worker loads
it and called through the same v2 bytes a gRPC call carries; the shards' answers put back in the
model's feature order equal the whole model's lookups, for any placement of the tables. And the
pieces around them: the plan and placement files, the shard's wire form, the deadline."""

from __future__ import annotations


import numpy as np
import orjson
import pytest
import torch

from archive_tools.distributed import build_distributed, shard_schema, stage_shard
from archive_tools.model_config import ServingConfig
from handlers.loading import load_service
from handlers.modeling.eager import EagerModel
from handlers.modeling.errors import SpecError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema
from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InternalError
from handlers.runtime.batching import coalesce
from handlers.runtime.inputs import JaggedIds, Output
from handlers.runtime.options import HandlerOptions
from handlers.runtime.remote.lookups import Answered, InProcessShard, ShardCaller, ShardedLookups, distinct_ids
from handlers.runtime.remote.plan import PLACEMENT_ENV, Deadline, RemotePlan, ShardRoute, read_placement
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.messages import BinaryBody, Rejected
from handlers.runtime.wire.v2_tensors import decode_response, encode_request
from tests.helpers import items_request


def _placed(spec, placement: dict[str, str]):
    return spec.replace(tables=[t.model_copy(update={"shard": placement[t.name]}) for t in spec.tables])


@pytest.fixture(params=["tiny", "ranker"])
def model(request, tiny_spec, tiny_weights, ranker_spec, ranker_weights):
    """(spec with tables on two shards, interleaved, quantized weights)."""
    if request.param == "tiny":  # shard a holds the first and last tables: features out of order
        placement = {"t_user": "a", "t_item": "b", "t_category": "b", "t_hour": "a"}
        return _placed(tiny_spec, placement), tiny_weights
    return _placed(ranker_spec, {"t_item": "b", "t_tag": "a", "t_seller": "b"}), ranker_weights


def _shards(spec, weights, tmp_path) -> list[InProcessShard]:
    shards = []
    for name in spec.shards:
        shard_spec = spec.shard_spec(name)
        stage_shard(tmp_path / name, shard_spec, weights.tables, spec.limits.to_limits())
        route = ShardRoute(name, shard_spec.name, shard_spec.feature_names, shard_spec.feature_dims)
        shards.append(InProcessShard(route, load_service(tmp_path / name, HandlerOptions(Artifact.LOOKUPS))))
    return shards


@pytest.mark.parametrize("sizes", [(1,), (3, 5), (40, 1, 7)])
def test_shards_answers_in_model_order_equal_the_whole_models_lookups(model, sizes, tmp_path):
    spec, weights = model
    factory = DLRMFactory(spec)
    whole = EagerModel(factory.lookups(weights), (input_schema(spec).jagged,))
    schema = input_schema(spec)
    decoder = RequestDecoder(schema)
    batch = coalesce([decoder.decode(items_request(spec, n, seed=n, max_bag=4)).inputs for n in sizes], schema.tags)
    with torch.inference_mode():
        expected = whole(batch)
    lookups = ShardedLookups(
        _shards(spec, weights, tmp_path), spec.feature_names, schema.jagged.name, spec.weighted_ids,
        stacked=expected.dim() == 3,
    )
    torch.testing.assert_close(lookups(batch), expected, atol=0, rtol=0)


def _candidates_request(spec, num_items: int, seed: int, varying: str) -> dict:
    """A ranking request: the user's bags repeated in every candidate, ``varying`` drawn per item."""
    request = items_request(spec, num_items, seed=seed, max_bag=4)
    user = request["items"][0]["sparse"]
    for item in request["items"]:
        item["sparse"] = {f: item["sparse"][f] if f == varying else user[f] for f in user}
    return request


class _Recording:
    """An in-process shard that keeps the bags counts of what it was sent."""

    def __init__(self, shard: InProcessShard) -> None:
        self.shard, self.route, self.sent = shard, shard.route, []

    def call(self, body: bytes, json_length: int):
        self.sent.append(_request_arrays(body, json_length)["sparse_features.bags"].tolist())
        return self.shard.call(body, json_length)


def _request_arrays(body: bytes, json_length: int) -> dict[str, np.ndarray]:
    header = orjson.loads(body[:json_length])
    arrays, offset = {}, json_length
    for tensor in header["inputs"]:
        size = tensor["parameters"]["binary_data_size"]
        arrays[tensor["name"]] = np.frombuffer(body[offset : offset + size], dtype=np.int64 if tensor["datatype"] == "INT64" else np.float32)
        offset += size
    return arrays


def test_repeated_bags_are_sent_once_and_answered_as_the_whole_model(model, tmp_path):
    spec, weights = model
    schema = input_schema(spec)
    decoder = RequestDecoder(schema)
    varying = spec.feature_names[1]
    requests = [_candidates_request(spec, n, seed=n, varying=varying) for n in (30, 1, 12)]
    batch = coalesce([decoder.decode(r).inputs for r in requests], schema.tags)
    with torch.inference_mode():
        expected = EagerModel(DLRMFactory(spec).lookups(weights), (schema.jagged,))(batch)
    shards = [_Recording(s) for s in _shards(spec, weights, tmp_path)]
    lookups = ShardedLookups(shards, spec.feature_names, schema.jagged.name, spec.weighted_ids, stacked=expected.dim() == 3)
    torch.testing.assert_close(lookups(batch), expected, atol=0, rtol=0)
    sent = {f: bags for s in shards for f, bags in zip(s.route.features, s.sent[0])}
    for f in spec.feature_names:
        if f == varying:  # drawn per item: most of the 43 bags differ from their neighbour's
            assert 20 < sent[f] <= 43, sent
        else:  # the user's bags: once a request (fewer where neighbouring requests agree)
            assert 1 <= sent[f] <= 3, sent


def test_a_shard_answering_the_wrong_number_of_embeddings_is_a_500_naming_it(tiny_spec):
    class Short:
        route = ShardRoute("a", "tiny-a", tiny_spec.feature_names, tiny_spec.feature_dims)

        def call(self, body: bytes, json_length: int) -> Answered:
            return Answered(torch.zeros(3))

    schema = input_schema(tiny_spec)
    batch = coalesce([RequestDecoder(schema).decode(items_request(tiny_spec, 2, seed=0)).inputs], schema.tags)
    lookups = ShardedLookups([Short()], tiny_spec.feature_names, schema.jagged.name, tiny_spec.weighted_ids, stacked=True)
    with pytest.raises(InternalError, match=r"shard a answered 3 values for \d+ \(its features' bags x widths\)"):
        lookups(batch)


def test_distinct_ids_keep_each_bag_that_differs_from_the_one_before():
    # feature 0: [1 2] [1 2] [] [] [1 2] ; feature 1: [3] [3] weights differ, [3] [4] [4]
    ids = JaggedIds(
        lengths=torch.tensor([[2, 2, 0, 0, 2], [1, 1, 1, 1, 1]]),
        values=torch.tensor([1, 2, 1, 2, 1, 2, 3, 3, 3, 4, 4]),
        weights=torch.tensor([1.0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]),
    )
    sent = distinct_ids(ids)
    assert sent.bags.tolist() == [3, 3]
    assert sent.row.tolist() == [[0, 0, 1, 1, 2], [0, 1, 1, 2, 2]]
    assert sent.ids.lengths.tolist() == [[2, 0, 2, 0, 0], [1, 1, 1, 0, 0]]
    assert sent.ids.values.tolist() == [1, 2, 1, 2, 3, 3, 4]
    assert sent.ids.weights.tolist() == [1, 1, 1, 1, 1, 2, 2]


def test_a_shard_answers_only_the_bags_it_is_told_of(tiny_spec):
    spec = _placed(tiny_spec, {"t_user": "a", "t_item": "a", "t_category": "b", "t_hour": "b"})
    schema = shard_schema(spec.shard_spec("a"), spec.limits.to_limits())
    assert schema.embedding_widths == (8, 8, 8)
    decoder = RequestDecoder(schema)
    lengths = np.array([[1, 0, 0], [2, 1, 0], [1, 1, 1]])

    def decode(bags):
        inputs = {"sparse_features.lengths": lengths, "sparse_features.values": np.arange(lengths.sum()),
                  "sparse_features.bags": np.array(bags)}
        return decoder.decode(BinaryBody(*encode_request(inputs, outputs=("embeddings",))))

    answer = decode([1, 2, 3]).encoder.answer(torch.arange(72, dtype=torch.float32).reshape(3, 24))
    embeddings = decode_response(answer.body, int(answer.headers["Inference-Header-Content-Length"]))["embeddings"]
    assert embeddings.tolist() == [*range(0, 8), *range(8, 16), *range(32, 40), *range(16, 24), *range(40, 48), *range(64, 72)]
    for bags, message in [
        ([1, 2], r"inputs\[2\] \(sparse_features.bags\).shape: must be \[3\], got \[2\]"),
        ([1, 4, 3], r"each must be in \[0, 3\]"),
        ([1, 1, 3], r"feature item_id, item 1\): must be 0: the feature's bags end at item 1"),
    ]:
        with pytest.raises(Rejected, match=message):
            decode(bags)


def test_a_shard_takes_v2_ids_only_and_answers_embeddings(tiny_spec):
    spec = _placed(tiny_spec, {"t_user": "a", "t_item": "a", "t_category": "b", "t_hour": "b"})
    schema = shard_schema(spec.shard_spec("a"), spec.limits.to_limits())
    assert schema.output == Output.EMBEDDINGS and schema.feature_names == ("user_id", "item_id", "last_item_id")
    decoder = RequestDecoder(schema)
    with pytest.raises(Rejected) as refused:
        decoder.decode(orjson.dumps(items_request(tiny_spec, 1, seed=0)))
    assert "embedding shard takes KServe v2 tensors" in refused.value.error.message
    inputs = {
        "sparse_features.lengths": np.array([[1, 0], [2, 1], [0, 0]]),
        "sparse_features.values": np.array([5, 6, 7, 8]),
    }
    body, length = encode_request(inputs, outputs=("scores",))
    with pytest.raises(Rejected) as refused:
        decoder.decode(BinaryBody(body, length))
    assert "outputs[0].name: must be one of ['embeddings']" in refused.value.error.message
    body, length = encode_request(inputs, outputs=("embeddings",))
    decoded = decoder.decode(BinaryBody(body, length))
    assert decoded.inputs.num_items == 2
    answer = decoded.encoder.answer(torch.ones(2, 24))
    assert decode_response(answer.body, int(answer.headers["Inference-Header-Content-Length"]))["embeddings"].shape == (2, 24)
    inputs["sparse_features.values"] = np.array([5, 6, 7, 10_000])
    body, length = encode_request(inputs, outputs=("embeddings",))
    with pytest.raises(Rejected) as refused:
        decoder.decode(BinaryBody(body, length))
    assert "feature item_id, item 1" in refused.value.error.message


def test_a_spec_places_every_table_or_none(tiny_spec):
    with pytest.raises((SpecError, ValueError), match=r"tables\[1\].shard: missing"):
        tiny_spec.replace(tables=[tiny_spec.tables[0].model_copy(update={"shard": "a"}), *tiny_spec.tables[1:]])
    spec = _placed(tiny_spec, {"t_user": "a", "t_item": "b", "t_category": "a", "t_hour": "b"})
    assert {name: [t.name for t in tables] for name, tables in spec.shards.items()} == {
        "a": ["t_user", "t_category"], "b": ["t_item", "t_hour"],
    }
    assert spec.shard_spec("b").name == "tiny-b"
    assert tiny_spec.shards == {}


def test_a_distributed_build_needs_shards(tiny_spec, tmp_path):
    tiny_spec.to_yaml(tmp_path / "spec.yaml")
    with pytest.raises(ValueError, match=r"tables\[\]\.shard: no table names its shard"):
        build_distributed(tmp_path / "spec.yaml", checkpoint=None, seed=0, name=None, version="1",
                          model_store=tmp_path / "store", serving=ServingConfig())


def test_the_plan_round_trips_and_names_bad_keys():
    plan = RemotePlan(
        Artifact.AOTI,
        (ShardRoute("a", "m-a", ("f1", "f2"), (8, 8)), ShardRoute("b", "m-b", ("f3",), (4,))),
        stacked=False,
        deadline=Deadline(floor_ms=10, max_ms=300),
    )
    assert RemotePlan.from_options(orjson.loads(orjson.dumps(plan.to_options()))) == plan
    options = HandlerOptions.from_mapping({"artifact": "remote", **plan.to_options()})
    assert options.remote == plan and options.describe() == "remote (dense dense_aoti.pt2; shards a, b)"
    for bad, message in [
        ({"shards": "a"}, "shards: must be a list"),
        ({"shards": [{"name": "a"}]}, r"shards\[0\]: needs name, model, features and widths"),
        ({"shards": [{"name": "a", "model": "m", "features": ["f"], "widths": [8, 8]}]}, "shards.a.widths"),
        ({**plan.to_options(), "deadline": {"max_ms": 5, "floor_ms": 10}}, "deadline.floor_ms: must not exceed"),
        ({**plan.to_options(), "deadline": {"timeout": 5}}, "deadline.timeout: unknown key"),
        ({**plan.to_options(), "dense": "eager"}, "dense: must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            RemotePlan.from_options(bad)
    placed = plan.placed({"a": ["h1:1", "h2:1"], "b": ["h3:1"]})
    assert [s.replicas for s in placed.shards] == [("h1:1", "h2:1"), ("h3:1",)]
    with pytest.raises(ValueError, match=r"no replica given for shard\(s\) \['b'\]"):
        plan.placed({"a": ["h1:1"]})


def test_the_placement_file_is_read_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(PLACEMENT_ENV, raising=False)
    with pytest.raises(ValueError, match=f"{PLACEMENT_ENV}: not set"):
        read_placement()
    path = tmp_path / "placement.yaml"
    path.write_text("shards:\n  a: ['127.0.0.1:7070', '127.0.0.1:7071']\n")
    monkeypatch.setenv(PLACEMENT_ENV, str(path))
    assert read_placement() == {"a": ["127.0.0.1:7070", "127.0.0.1:7071"]}
    path.write_text("shards:\n  a: [7070]\n")
    with pytest.raises(ValueError, match=r"shards.a: must be a list of host:port"):
        read_placement()


def test_the_attempt_timeout_follows_the_measured_calls_and_failed_replicas_go_last():
    deadline = Deadline(floor_ms=20, max_ms=500, multiple=4, retry_after_s=60)
    caller = ShardCaller(ShardRoute("a", "m-a", ("f",), (8,), ("127.0.0.1:1", "127.0.0.1:2")), deadline)
    try:
        assert caller.attempt_timeout_s() == 0.5  # nothing measured yet: the most
        for _ in range(100):
            caller._succeeded(0, 0.010)
        assert caller.attempt_timeout_s() == pytest.approx(0.040)  # 4 x p99
        for _ in range(300):
            caller._succeeded(0, 0.001)  # the window moves on: the 10 ms calls are gone
        assert caller.attempt_timeout_s() == pytest.approx(0.020)  # 4 ms, raised to the floor
        caller._failed(0, "UNAVAILABLE", 0.001)
        assert [caller.replica_order(now=0)[0] for _ in range(4)] == [1, 1, 1, 1]
        assert caller.counts[("ShardCalls", (("Shard", "a"), ("Outcome", "UNAVAILABLE")))] == 1
    finally:
        caller.close()
