"""The benchmark's traffic: valid for the model, skewed like production, replayable from a trace."""

import numpy as np
import orjson

from benchmarks.traffic import Traffic, TrafficModel
from handlers.modeling.registry import input_schema
from handlers.runtime.wire.decoder import RequestDecoder


def test_generated_requests_decode_and_repeat_the_user_context(tiny_spec):
    model = TrafficModel(items_per_request=10, mean_bag=2.0, candidate_features=("item_id",))
    traffic = model.generate(tiny_spec, num_requests=20, seed=0)
    decoder = RequestDecoder(input_schema(tiny_spec))
    for body in traffic.bodies:
        decoder.decode(body)  # raises on anything the server would refuse
        items = orjson.loads(body)["items"]
        assert len(items) == 10
        assert all(item["sparse"]["user_id"] == items[0]["sparse"]["user_id"] for item in items)
        assert all(item["dense"] == items[0]["dense"] for item in items)
    assert traffic.items == [10] * 20


def test_ranker_requests_carry_one_context(ranker_spec):
    traffic = TrafficModel(items_per_request=5).generate(ranker_spec, num_requests=3, seed=1)
    for body in traffic.bodies:
        assert RequestDecoder(input_schema(ranker_spec)).decode(body).inputs.num_items == 5
        assert len(orjson.loads(body)["context"]) == ranker_spec.context_features


def test_ids_are_skewed_towards_a_few_hot_rows(tiny_spec):
    traffic = TrafficModel(items_per_request=1, mean_bag=3.0).generate(tiny_spec, 2000, seed=2)
    ids = [i for body in traffic.bodies for i in orjson.loads(body)["items"][0]["sparse"]["user_id"]]
    _, counts = np.unique(ids, return_counts=True)
    top_share = np.sort(counts)[::-1][:10].sum() / len(ids)
    # Uniform ids would give the 10 hottest of 1000 rows about 1% of lookups; Zipf(1.1) gives ~26%.
    assert top_share > 0.15


def test_drawn_item_counts_vary_within_bounds(tiny_spec):
    traffic = TrafficModel(items_per_request=50, draw_items=True).generate(tiny_spec, 200, seed=4)
    assert traffic.items == [len(orjson.loads(b)["items"]) for b in traffic.bodies]
    assert min(traffic.items) >= 1 and max(traffic.items) <= 50 and len(set(traffic.items)) > 20


def test_trace_round_trip(tiny_spec, tmp_path):
    traffic = TrafficModel(items_per_request=3, draw_items=True).generate(tiny_spec, num_requests=7, seed=3)
    traffic.write_trace(tmp_path / "trace.jsonl")
    replayed = Traffic.read_trace(tmp_path / "trace.jsonl")
    assert replayed.bodies == traffic.bodies and replayed.items == traffic.items


def test_example_form_holds_the_same_requests_as_the_dlrm_example_sends_them(tiny_spec, ranker_spec, tmp_path):
    """The example form (flat float_features, lengths and ids feature-major) decodes to exactly
    the tensors of the items-form bodies it was made from, and a trace of it replays with the
    right item counts."""
    for spec in (tiny_spec, ranker_spec):
        schema = input_schema(spec)
        traffic = TrafficModel(items_per_request=3, mean_bag=2.0, draw_items=True).generate(spec, 12, seed=5)
        example = traffic.as_example_form(schema)
        decoder = RequestDecoder(schema)
        assert example.items == traffic.items
        for items_body, example_body in zip(traffic.bodies, example.bodies):
            sent = orjson.loads(example_body)
            assert sent.keys() - {"context"} == {"float_features", "id_list_features.lengths", "id_list_features.values"}
            assert not isinstance(sent["float_features"][0], list)  # flat, as the example's clients send
            want, got = decoder.decode(items_body).inputs.tensors, decoder.decode(example_body).inputs.tensors
            for name, tensor in want.items():
                if hasattr(tensor, "lengths"):
                    assert got[name].lengths.tolist() == tensor.lengths.tolist()
                    assert got[name].values.tolist() == tensor.values.tolist()
                else:
                    assert got[name].tolist() == tensor.tolist()
        example.write_trace(tmp_path / f"{spec.name}.jsonl")
        replayed = Traffic.read_trace(tmp_path / f"{spec.name}.jsonl", spec.dense_features)
        assert replayed.items == traffic.items
