"""Embedding-dense distributed inference on loopback: shard hosts and a dense host, each a real
TorchServe started by the launcher, the dense host calling the shards over gRPC. Scores equal the
single-host model's; a replica going down or hanging is failed over with no failed request; a
shard with no replica left is a 503 naming it, within the deadline, and serving recovers by
itself."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from archive_tools.model_config import ServingConfig
from archive_tools.cli import main
from archive_tools.distributed import build_distributed, split_delta
from archive_tools.launcher import HostGroup, LayoutFile, LocalLayout
from benchmarks.distributed import answer_kib, shard_hop
from benchmarks.traffic import TrafficModel
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import TABLES, WEIGHTS
from tests.conftest import TINY_SPEC
from tests.helpers import items_request

pytestmark = pytest.mark.integration

# table -> shard. (A ranker's shard lookups, with weighted ids, are tests/handlers/runtime/
# test_remote.py's, through the bytes a shard call carries, against shards loaded in process.)
PLACEMENTS = {"tiny": {"t_user": "a", "t_category": "a", "t_item": "b", "t_hour": "b"}}


def _layout(tmp_path_factory, spec_path, replicas: dict[str, int]):
    spec = load_spec(spec_path)
    placement = PLACEMENTS[spec.name]
    sharded = spec.replace(tables=[t.model_copy(update={"shard": placement[t.name]}) for t in spec.tables])
    folder = tmp_path_factory.mktemp(f"distributed-{spec.name}")
    sharded.to_yaml(folder / "spec.yaml")
    store = folder / "model_store"
    build_distributed(
        folder / "spec.yaml", checkpoint=None, seed=0, name=None, version="1.0", model_store=store,
        serving=ServingConfig(batch_size=16, max_batch_delay_ms=20),
    )
    factory = DLRMFactory(sharded)
    single_host = eager_service(sharded, factory.inference_model(factory.quantize(factory.float_model(seed=0))))
    layout = LayoutFile(
        model_store=store,
        dense=HostGroup(f"{spec.name}-dense"),
        shards={shard: HostGroup(f"{spec.name}-{shard}", replicas.get(shard, 1)) for shard in sharded.shards},
    )
    return sharded, single_host, layout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec, single_host, layout = _layout(tmp_path_factory, TINY_SPEC, {"a": 2})
    with LocalLayout(layout) as running:
        yield spec, single_host, running


def _expected(single_host, request: dict) -> torch.Tensor:
    decoded = single_host.decoder.decode(request)
    (logits,) = single_host.logits([decoded.inputs])
    return torch.sigmoid(logits)


def _scores(layout: LocalLayout, model: str, request: dict) -> requests.Response:
    return layout.dense[0].predict(model, request, timeout_s=30)


def test_scores_equal_the_single_host_model_solo_and_batched(tiny):
    """Multi-hot bags, many items per request: each request alone, then 24 at once (coalesced by
    the dense host into shared shard calls)."""
    spec, single_host, layout = tiny
    model = f"{spec.name}-dense"
    bodies = [items_request(spec, num_items=1 + k % 7, seed=300 + k, max_bag=4) for k in range(24)]
    for body in bodies[:4]:
        response = _scores(layout, model, body)
        assert response.status_code == 200, response.text
        torch.testing.assert_close(torch.tensor(response.json()["scores"]), _expected(single_host, body),
                                   atol=1e-6, rtol=0)
    with ThreadPoolExecutor(max_workers=12) as pool:
        responses = list(pool.map(lambda b: _scores(layout, model, b), bodies))
    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        torch.testing.assert_close(torch.tensor(response.json()["scores"]), _expected(single_host, body),
                                   atol=1e-6, rtol=0)


def test_bad_input_is_a_400_naming_the_field(tiny):
    spec, _, layout = tiny
    body = items_request(spec, num_items=2, seed=1)
    body["items"][1]["sparse"]["item_id"] = [10_000]
    response = _scores(layout, "tiny-dense", body)
    assert response.status_code == 400
    assert "items[1].sparse.item_id[0]" in response.json()["message"]


class _Load:
    """Requests sent one after another from ``threads`` threads until stopped; every answer's
    status kept."""

    def __init__(self, layout: LocalLayout, spec, threads: int = 3) -> None:
        self.statuses: list[int] = []
        self.bodies: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._send, args=(layout, spec, k), daemon=True) for k in range(threads)
        ]

    def _send(self, layout: LocalLayout, spec, k: int) -> None:
        n = 0
        while not self._stop.is_set():
            response = _scores(layout, f"{spec.name}-dense", items_request(spec, num_items=4, seed=k * 10_000 + n))
            self.statuses.append(response.status_code)
            if response.status_code != 200:
                self.bodies.append(response.text)
            n += 1

    def __enter__(self) -> "_Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def answered(self, more: int, timeout_s: float = 60) -> None:
        """Returns once ``more`` further requests are answered (polled, not slept for)."""
        wanted = len(self.statuses) + more
        deadline = time.monotonic() + timeout_s
        while len(self.statuses) < wanted:
            assert time.monotonic() < deadline, f"{more} answers not within {timeout_s}s"
            time.sleep(0.02)


def test_a_replica_killed_and_restarted_under_load_fails_no_request(tiny):
    spec, _, layout = tiny
    replica = layout.shards["a"][0]
    with _Load(layout, spec) as load:
        load.answered(20)
        replica.stop()
        load.answered(40)  # with one replica of shard a
        layout.revive("a", 0)
        load.answered(40)  # with both again
    assert len(load.statuses) >= 100
    assert set(load.statuses) == {200}, load.bodies[:3]


def test_a_hung_replica_is_failed_over_within_the_deadline(tiny):
    """A replica that stops answering (its processes stopped) costs each call one attempt's
    timeout, then the other replica answers: no request fails, none waits past the deadline."""
    spec, _, layout = tiny
    group = layout.shards["a"][0].process.pid
    os.killpg(group, signal.SIGSTOP)
    try:
        with _Load(layout, spec) as load:
            load.answered(30)  # each call tries the hung replica once, then the other
    finally:
        os.killpg(group, signal.SIGCONT)
    assert len(load.statuses) >= 30
    assert set(load.statuses) == {200}, load.bodies[:3]


def test_a_shard_with_no_replica_is_a_503_naming_it_and_serving_recovers(tiny):
    spec, single_host, layout = tiny
    (host,) = layout.shards["b"]
    body = items_request(spec, num_items=3, seed=7)
    host.stop()
    try:
        started = time.perf_counter()
        response = _scores(layout, "tiny-dense", body)
        answered_s = time.perf_counter() - started
        assert response.status_code == 503, response.text
        assert "shard 'b'" in response.json()["message"]
        assert answered_s < 3.0  # the deadline (at most 500 ms per replica) plus batching: no hang
    finally:
        layout.revive("b", 0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        response = _scores(layout, "tiny-dense", body)
        if response.status_code == 200:
            break
        time.sleep(0.2)
    assert response.status_code == 200, response.text
    torch.testing.assert_close(torch.tensor(response.json()["scores"]), _expected(single_host, body),
                               atol=1e-6, rtol=0)


def test_shard_calls_are_metrics_by_shard_and_outcome(tiny):
    spec, _, layout = tiny
    assert _scores(layout, "tiny-dense", items_request(spec, num_items=2, seed=3)).status_code == 200
    dense = layout.dense[0]
    calls: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(dense.scrape("tiny-dense")):
        if family.name == "ShardCalls":
            for sample in family.samples:
                key = (sample.labels["Shard"], sample.labels["Outcome"])
                calls[key] = calls.get(key, 0) + sample.value
    assert calls.get(("a", "ok"), 0) > 0 and calls.get(("b", "ok"), 0) > 0, calls


def test_a_delta_of_the_dense_archive_takes_a_rows_file_alone(tiny, tmp_path, capsys):
    _, _, layout = tiny
    dense = layout.layout.model_store / "tiny-dense.mar"
    assert main(["delta", str(dense), "--checkpoint", str(tmp_path / "trained.pt"), "--sequence", "1"]) == 2
    assert "its tables are on its shards; give --rows (and --sequence) alone" in capsys.readouterr().err
    torch.save({"t_nowhere": {"ids": torch.tensor([0]), "rows": torch.zeros(1, 8)}}, tmp_path / "rows.pt")
    with pytest.raises(ValueError, match=r"tables \['t_nowhere'\] are on no shard"):
        split_delta(dense, tmp_path / "rows.pt", sequence=1)


def test_the_dense_archive_holds_no_table_layout_and_refuses_row_deltas_naming_why(tiny):
    """Its tables live on the shards: no tables.json rides along (the plugin would name a delta log
    for tables it does not hold), and a publish to it is a 409 that says where the tables are."""
    _, _, layout = tiny
    with Archive.open(layout.layout.model_store / "tiny-dense.mar") as dense:
        assert not dense.has(TABLES) and not dense.has(WEIGHTS) and dense.layout is None
    with Archive.open(layout.layout.model_store / "tiny-a.mar") as shard:
        assert {t.name for t in shard.layout.tables} == {"t_user", "t_category"}
    response = layout.dense[0].management("POST", "/freshness/tiny-dense", params={"delta": "any.delta"})
    assert response.status_code == 409, response.text
    assert "holds no tables: its embedding shards do" in response.json()["message"]


def test_a_rows_delta_reaches_the_shard_that_owns_each_table_on_every_host(tiny, tmp_path):
    """Last in this module: it changes the served rows. New rows for a table of each shard, split
    by the layout's delta command into one delta per shard, published to every shard host: each
    host's watermark reaches it, and the dense host's scores are a fresh build's with those rows."""
    spec, _, layout = tiny
    generator = torch.Generator().manual_seed(5)
    touched = {
        "t_user": {"ids": torch.tensor([1, 2, 7]), "rows": torch.randn(3, 8, generator=generator)},
        "t_hour": {"ids": torch.tensor([5, 23]), "rows": torch.randn(2, 8, generator=generator)},
    }
    torch.save(touched, tmp_path / "touched.pt")
    store = layout.layout.model_store
    written = split_delta(store / "tiny-dense.mar", tmp_path / "touched.pt", sequence=1)
    assert {s.path.name: s.rows_by_table for s in written} == {
        "tiny-a-00000001.delta": {"t_user": 3}, "tiny-b-00000001.delta": {"t_hour": 2},
    }
    layout.publish(sequence=1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        watermarks = {host: state["applied_sequence"] for host, state in layout.freshness().items()}
        if set(watermarks.values()) == {1}:
            break
        time.sleep(0.2)
    assert watermarks == {"a-0": 1, "a-1": 1, "b-0": 1}

    factory = DLRMFactory(spec)
    model = factory.float_model(seed=0)
    bags = model.sparse_arch.embedding_bag_collection.embedding_bags
    with torch.no_grad():
        for table, change in touched.items():
            bags[table].weight[change["ids"]] = change["rows"]
    fresh = eager_service(spec, factory.inference_model(factory.quantize(model)))
    body = {"items": [
        {"dense": [0.1, 0.2, 0.3, 0.4], "sparse": {"user_id": [1, 7], "hour": [5], "item_id": [3]}},
        {"dense": [1.0, 0.0, -1.0, 2.0], "sparse": {"user_id": [2], "hour": [23], "category": [4]}},
    ]}
    response = _scores(layout, "tiny-dense", body)
    assert response.status_code == 200, response.text
    torch.testing.assert_close(torch.tensor(response.json()["scores"]), _expected(fresh, body), atol=1e-6, rtol=0)


def test_the_benchmarks_own_figures_on_a_running_layout(tiny):
    """What only the distributed benchmark measures (everything else its smoke run checked is
    checked above): the shard hop timed from this process against a running layout, and the bags
    the shards answer, each distinct bag once per request."""
    spec, _, layout = tiny
    candidates = TrafficModel(items_per_request=100, candidate_features=("item_id",)).generate(spec, 16, seed=2)
    hop = shard_hop(layout, spec, candidates, duration_s=0.5)
    assert 0 < hop["shard_handler_ms_per_call"] < hop["shard_lookups_p50_ms"], hop
    answered = answer_kib(spec, candidates)
    assert answered["shard_answer_kib_per_request"] < 0.5 * answered["shard_answer_kib_per_request_all_bags"]
