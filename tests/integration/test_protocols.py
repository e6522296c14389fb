"""The wire forms and metrics through a real TorchServe: TorchServe's DLRM example's own request
shape, the KServe v2 protocol (by hand and with Triton's standard client), and the handler's
per-stage metrics on the Prometheus endpoint after traffic."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.verification import Bounds
from archive_tools.local_server import LocalTorchServe
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.runtime.artifacts import Artifact
from tests.conftest import CRITEO_SPEC, TINY_SPEC
from tests.helpers import archive_service, items_request, pruned

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """tiny.mar (reject policy), criteo_small.mar (the Criteo shape, 1,000-row tables that hash
    ids beyond them, as a Criteo 1TB client's ids are here) and tiny_pruned.mar (three tables
    pruned, an exported program)."""
    root = tmp_path_factory.mktemp("protocols")
    tiny_pruned, _ = pruned(load_spec(TINY_SPEC).replace(name="tiny_pruned"), root)
    tiny_pruned.to_yaml(root / "tiny_pruned.yaml")
    build_archive(root / "tiny_pruned.yaml", checkpoint=None, seed=0, name=None, version="1.0",
                  model_store=root / "model_store", serving=ServingConfig(batch_size=8, max_batch_delay_ms=50),
                  artifact=Artifact.EXPORTED, bounds=Bounds(max_auc_drop=1.0, max_ne_increase=1.0))
    criteo = load_spec(CRITEO_SPEC)
    criteo = criteo.replace(
        name="criteo_small", tables=[t.model_copy(update={"rows": min(t.rows, 1000)}) for t in criteo.tables]
    )
    criteo.to_yaml(root / "criteo_small.yaml")
    serving = ServingConfig(batch_size=8, max_batch_delay_ms=50)
    for spec in (TINY_SPEC, root / "criteo_small.yaml"):
        build_archive(spec, checkpoint=None, seed=0, name=None, version="1.0",
                      model_store=root / "model_store", serving=serving)
    return root / "model_store"


@pytest.fixture(scope="module")
def server(store):
    with LocalTorchServe(model_store=store) as server:
        for name in ("tiny", "criteo_small", "tiny_pruned"):
            assert server.register(f"{name}.mar").status_code == 200
        yield server


@pytest.fixture(scope="module")
def tiny_reference(store, tmp_path_factory):
    return archive_service(store / "tiny.mar")


def _scores(service, body: dict) -> list[float]:
    return json.loads(service.handle([json.dumps(body)]).responses[0].body)["scores"]


def test_torchserve_dlrm_example_request_shape(server, store, tmp_path):
    """One item as TorchServe's example client sends it: 13 flat floats, 26 bags of one id each
    (Criteo 1TB ids); answered with our scores and the example's "default" logits."""
    body = {
        "float_features": [0.3, -1.1, 0.8, 0.05, -0.4, 1.7, 0.2, -0.9, 0.6, 1.2, -0.3, 0.0, 0.45],
        "id_list_features.lengths": [1] * 26,
        "id_list_features.values": [38120577, 20315, 1093, 55, 9871, 1, 4410, 872, 12, 21873099,
                                    1009931, 288001, 7, 1544, 10227, 99, 2, 611, 9, 40110244,
                                    7718280, 33567012, 301777, 11002, 57, 19],
    }
    response = server.predict("criteo_small", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    reference = archive_service(store / "criteo_small.mar")
    assert answer["scores"] == pytest.approx(_scores(reference, body), abs=1e-6)
    assert answer["scores"] == pytest.approx(1 / (1 + np.exp(-np.array(answer["default"]))), abs=1e-6)


def _v2_body(spec, request: dict) -> dict:
    """The items-form ``request`` as a KServe v2 body."""
    items = request["items"]
    features = spec.feature_names
    lengths = [[len(item["sparse"].get(f, [])) for item in items] for f in features]
    values = [i for f in features for item in items for i in item["sparse"].get(f, [])]
    return {
        "id": "v2-1",
        "inputs": [
            {"name": "dense_features", "datatype": "FP32", "shape": [len(items), spec.dense_features],
             "data": [x for item in items for x in item["dense"]]},
            {"name": "sparse_features.lengths", "datatype": "INT64", "shape": [len(features), len(items)],
             "data": lengths},
            {"name": "sparse_features.values", "datatype": "INT64", "shape": [len(values)], "data": values},
        ],
    }


def test_kserve_v2_requests_are_batched_and_score_as_json(server, tiny_spec, tiny_reference):
    requests_ = [items_request(tiny_spec, n, seed=60 + n, max_bag=4) for n in (1, 5, 12, 3) * 4]
    url = f"{server.inference_url}/v2/models/tiny/infer"
    headers = {**server.auth("inference"), "Content-Type": "application/json"}
    with ThreadPoolExecutor(max_workers=len(requests_)) as pool:
        answers = list(pool.map(
            lambda r: requests.post(url, data=json.dumps(_v2_body(tiny_spec, r)), headers=headers, timeout=60),
            requests_,
        ))
    for request, answer in zip(requests_, answers):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["model_name"] == "tiny" and body["id"] == "v2-1"
        (scores,) = body["outputs"]
        assert scores["name"] == "scores" and scores["datatype"] == "FP32"
        assert scores["shape"] == [len(request["items"])]
        assert scores["data"] == pytest.approx(_scores(tiny_reference, request), abs=1e-6)

    bad = _v2_body(tiny_spec, requests_[0])
    bad["inputs"][0]["shape"] = [1, 9]
    answer = requests.post(url, data=json.dumps(bad), headers=headers, timeout=60)
    assert answer.status_code == 400
    assert answer.json() == {"error": "inputs[0] (dense_features).shape: must be [n, 4], got [1, 9]"}


@pytest.mark.parametrize("binary", [True, False], ids=["binary tensors", "json tensors"])
def test_tritons_standard_v2_client_works_unchanged(server, tiny_spec, tiny_reference, binary):
    """Triton's HTTP client, as it comes: binary tensors both ways by default, or JSON."""
    request = items_request(tiny_spec, 6, seed=77, max_bag=3)
    v2 = _v2_body(tiny_spec, request)["inputs"]
    client = triton.InferenceServerClient(server.inference_url.removeprefix("http://"))
    inputs = []
    for tensor, dtype in zip(v2, (np.float32, np.int64, np.int64)):
        array = np.asarray(tensor["data"], dtype=dtype).reshape(tensor["shape"])
        triton_input = triton.InferInput(tensor["name"], list(array.shape), tensor["datatype"])
        triton_input.set_data_from_numpy(array, binary_data=binary)
        inputs.append(triton_input)
    outputs = [triton.InferRequestedOutput(name, binary_data=binary) for name in ("scores", "logits")]
    result = client.infer("tiny", inputs, outputs=outputs, headers=server.auth("inference"))
    scores = result.as_numpy("scores")
    assert scores.shape == (6,)
    assert scores.tolist() == pytest.approx(_scores(tiny_reference, request), abs=1e-6)
    assert (1 / (1 + np.exp(-result.as_numpy("logits")))).tolist() == pytest.approx(scores.tolist(), abs=1e-6)


def _metrics(server, model: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without ModelName/Level/Hostname): value} for ``model``
    (the parser's ``_total`` suffix of counters left off)."""
    text = server.scrape(model)
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("ModelName") == model:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                      if k not in ("ModelName", "Level", "Hostname")))
                samples[(sample.name.removesuffix("_total"), labels)] = sample.value
    return samples


def test_per_stage_metrics_count_the_traffic(server, tiny_spec):
    """After known traffic: every batch timed in each stage, refusals counted by reason."""
    before = _metrics(server, "tiny")
    good = [items_request(tiny_spec, 2, seed=k) for k in range(5)]
    bad = [b"{broken", {"items": [{"dense": [0] * 4, "colour": 1}]},
           {"items": [{"dense": [0] * 4, "sparse": {"user_id": [10**6]}}]}]
    for body in good + bad:
        server.predict("tiny", body if isinstance(body, bytes) else json.dumps(body))
    after = _metrics(server, "tiny")

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    batches = sum(grew("HandlerBatches", Requests=str(k)) * k for k in range(1, 9))
    assert batches == len(good) + len(bad)
    for stage in ("decode", "coalesce", "forward", "encode"):
        assert grew("HandlerStageMilliseconds", Stage=stage) > 0, stage
    assert grew("HandlerForwardItems") == 2 * len(good)
    assert grew("HandlerRejectedRequests", Reason="malformed_body") == 1
    assert grew("HandlerRejectedRequests", Reason="unknown_field") == 1
    assert grew("HandlerRejectedRequests", Reason="id_out_of_range") == 1


def test_hashed_ids_are_counted(server):
    spec = load_spec(CRITEO_SPEC)
    before = _metrics(server, "criteo_small").get(("HandlerHashedIds", ()), 0)
    body = {"float_features": [0.0] * 13, "id_list_features.lengths": [2] + [0] * 25,
            "id_list_features.values": [5_000, 999]}
    assert server.predict("criteo_small", body).status_code == 200
    after = _metrics(server, "criteo_small").get(("HandlerHashedIds", ()), 0)
    assert after - before == 1 and spec.feature_names[0] == "cat_0"


def test_a_pruned_model_serves_what_the_eager_model_scores_and_counts_its_pruned_ids(server, tmp_path):
    """The exported program (FBGEMM's index remapping inside the graph) through TorchServe, against
    the factory's eager model of the same spec and seed in process."""
    spec = load_spec(TINY_SPEC)
    pruned_spec, kept = pruned(spec, tmp_path)  # the same seeded kept ids as the archive's
    factory = DLRMFactory(pruned_spec)
    reference = eager_service(pruned_spec, factory.inference_model(factory.quantize(factory.float_model(seed=0))))
    before = _metrics(server, "tiny_pruned")
    bodies = [items_request(spec, 16, seed=s, max_bag=6) for s in range(3)]
    for body in bodies:
        response = server.predict("tiny_pruned", body)
        assert response.status_code == 200, response.text
        assert response.json()["scores"] == pytest.approx(_scores(reference, body), abs=1e-6)
    table_of = {f: t.name for t in spec.tables for f in t.features}
    expected = dict.fromkeys(kept, 0)
    for body in bodies:
        for item in body["items"]:
            for feature, ids in item["sparse"].items():
                if table_of[feature] in kept:
                    expected[table_of[feature]] += int((~np.isin(ids, kept[table_of[feature]].numpy())).sum())
    after = _metrics(server, "tiny_pruned")
    counted = {t: after.get(("HandlerPrunedIds", (("Table", t),)), 0) - before.get(("HandlerPrunedIds", (("Table", t),)), 0)
               for t in kept}
    assert counted == expected and all(expected.values())


def test_the_grafana_dashboard_plots_metrics_the_server_publishes(server, tiny_spec):
    """Every metric the shipped dashboard queries exists on the Prometheus endpoint after traffic."""
    from archive_tools.resources import config_dir

    assert server.predict("tiny", items_request(tiny_spec, 1, seed=1)).status_code == 200
    assert server.predict("tiny", b"{broken").status_code == 400  # a refusal, counted
    hashed = {"float_features": [0.0] * 13, "id_list_features.lengths": [1] + [0] * 25,
              "id_list_features.values": [123_456]}
    assert server.predict("criteo_small", hashed).status_code == 200  # an id hashed, counted
    pruned_id = {"items": [{"dense": [0.0] * 4, "sparse": {"user_id": list(range(20))}}]}  # 20 ids: some pruned
    assert server.predict("tiny_pruned", pruned_id).status_code == 200
    server.scrape("tiny_pruned")  # flushes its worker's counts and waits for them
    dashboard = json.loads((config_dir() / "grafana" / "torchrec-serve.json").read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {
        re.sub(r"_(bucket|sum|count|total)$", "", name)
        for expr in expressions
        for name in re.findall(r"\b(ts_[a-z_]+|Handler[A-Za-z_]+)\{", expr)
    }
    text = server.scrape("tiny")
    published = {family.name for family in text_string_to_metric_families(text)}
    raw_id_panel = {"HandlerUnseenIds", "HandlerRawIds"}  # published by raw-id models: test_raw_ids checks them
    assert len(queried) >= 8 and queried - raw_id_panel <= published, queried - published
