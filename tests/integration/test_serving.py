"""Serving behaviour, the same on both engines: each test runs against TorchServe and against the
ASGI engine (``engine``, one server of each for the module, two worker processes a model), on the
same archives, checked against those archives loaded in this process and against the float model:
scores, batches scored as alone, every bad input answered with the field, keys, 413, a delta
published under load with no failed request and rolled back, the handler's counters on each
engine's metrics endpoint, and a killed worker replaced with only its own requests failing.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch

from archive_tools.build import build_archive
from archive_tools.delta import DeltaSource, make_delta, served_rows
from archive_tools.local_server import HandlerCounters
from archive_tools.model_config import ServingConfig
from archive_tools.verification import Bounds
from benchmarks.load import BackgroundLoad
from benchmarks.traffic import TrafficModel
from handlers.runtime.artifacts import Artifact
from handlers.runtime.freshness.delta_file import DeltaWriter
from handlers.runtime.freshness.layout import TablesLayout
from handlers.runtime.service import ScoringService
from handlers.runtime.wire.transport import Arrival
from tests.conftest import TINY_SPEC
from tests.handlers.runtime.test_decode import BAD_REQUESTS
from tests.helpers import QUANTIZATION_TOLERANCE, archive_service, float_scores, items_request
from tests.integration.engines import ENGINES, Engine, serving_processes, start_engine, worker_pids
from tests.integration.publishing_archives import checkpoints, newer_dense

pytestmark = pytest.mark.integration

BATCH_SIZE = 8
MAX_BATCH_DELAY_MS = 50  # long enough that concurrent requests land in one batch
WORKERS = 2
SERVING = ServingConfig(batch_size=BATCH_SIZE, max_batch_delay_ms=MAX_BATCH_DELAY_MS)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    """tiny.mar (eager, from a base checkpoint), the same spec as a folder of tables made in their
    served dtypes (tiny_folder), and a delta to a newer checkpoint; the in-process services."""
    root = tmp_path_factory.mktemp("serving")
    base, newer = checkpoints(root)
    store = root / "model_store"
    build_archive(TINY_SPEC, checkpoint=base, seed=0, name="tiny", version="1.0", model_store=store, serving=SERVING)
    build_archive(TINY_SPEC, checkpoint=None, seed=5, name="tiny_folder", version="1.0", model_store=store,
                  serving=SERVING, quantized_init=True, archive_format="no-archive", bounds=Bounds(max_abs_score_diff=0.0))
    fresh = build_archive(TINY_SPEC, checkpoint=newer, seed=0, name="tiny", version="1.0", model_store=root / "fresh",
                          serving=SERVING, artifact=Artifact.EAGER)
    (store / "deltas").mkdir()
    make_delta(store / "tiny.mar", DeltaSource(checkpoint=newer), store / "deltas" / "tiny-1.delta", sequence=1)
    newest = newer_dense(newer)  # its dense layers trained further too: a delta of rows and dense weights
    make_delta(store / "tiny.mar", DeltaSource(checkpoint=newest, dense=newest), store / "deltas" / "dense-1.delta", sequence=1)
    fresh_dense = build_archive(TINY_SPEC, checkpoint=newest, seed=0, name="tiny", version="1.0",
                                model_store=root / "fresh_dense", serving=SERVING)
    services = {"tiny": archive_service(store / "tiny.mar"), "tiny_folder": archive_service(store / "tiny_folder"),
                "fresh": archive_service(fresh), "fresh_dense": archive_service(fresh_dense)}
    with zipfile.ZipFile(store / "tiny.mar") as archive:
        archive.extractall(root / "unpacked")
    return {"store": store, "services": services, "layout": TablesLayout.load(root / "unpacked")}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, store, tmp_path_factory):
    server = start_engine(request.param, store["store"], ["tiny.mar", "tiny_folder"], WORKERS,
                          tmp_path_factory.mktemp(request.param))
    try:
        serving_processes(server, "tiny", WORKERS)  # both processes serve before the tests start
        yield server
    finally:
        server.stop()


def _in_process(service: ScoringService, body: bytes | str | dict, content_type: str = "application/json",
                encoding: str | None = None) -> tuple[int, bytes]:
    """The in-process service's answer to one request sent alone: (status, body bytes)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
    form = content_type.startswith(("application/x-www-form-urlencoded", "multipart/form-data"))
    response = service.handle([Arrival(None if form else data, content_type, encoding, None)]).responses[0]
    return response.status, response.body


def test_concurrent_requests_are_batched_and_score_as_alone(engine, tiny_spec):
    """Batches formed of several requests (the handler's counters on the engine's metrics
    endpoint, every request counted once; it runs first, so that they count nothing else), each
    request's scores its solo scores."""
    requests_ = [
        items_request(tiny_spec, n_items, seed=100 + i, max_bag=bag)
        for i, (n_items, bag) in enumerate([(1, 0), (3, 7), (1, 20), (17, 2), (2, 50), (8, 1)] * 4)
    ]
    alone = [engine.post("/predictions/tiny", r).json()["scores"] for r in requests_]
    before = _counted(engine, "tiny", HandlerCounters({}, 0, 0), len(requests_))  # the module's first requests
    with ThreadPoolExecutor(max_workers=len(requests_)) as pool:
        together = list(pool.map(lambda r: engine.post("/predictions/tiny", r), requests_))
    for response, solo in zip(together, alone):
        assert response.status_code == 200, response.text
        assert response.json()["scores"] == pytest.approx(solo, abs=1e-6)
    formed = _counted(engine, "tiny", before, len(requests_))
    assert formed.forward_items == sum(len(r["items"]) for r in requests_), formed
    assert 1 < max(formed.batches) <= BATCH_SIZE, f"no batch of several requests: {formed}"


def _counted(engine: Engine, model: str, before: HandlerCounters, count: int, timeout_s: float = 30) -> HandlerCounters:
    """The counters since ``before`` once they hold ``count`` requests (a TorchServe worker that
    the describe call did not reach publishes its counts when idle: ``metrics_flush_s``)."""
    deadline = time.monotonic() + timeout_s
    while (formed := engine.counters(model).minus(before)).requests != count:
        assert formed.requests < count and time.monotonic() < deadline, f"not {count} requests counted: {formed}"
        time.sleep(0.2)
    return formed


@pytest.mark.parametrize("model", ["tiny", "tiny_folder"])
def test_scores_are_the_in_process_service_s_and_the_float_model_s(engine, store, tiny_spec, tiny_float_model, model):
    """Byte for byte the archive's answer in process; within the quantization tolerance the float
    TorchRec model's (inputs made without the serving decoder; tiny.mar was built from its
    weights, the base checkpoint)."""
    service = store["services"][model]
    for n, seed in ((1, 1), (5, 2), (100, 3)):
        request = items_request(tiny_spec, n, seed=seed, max_bag=5, return_logits=True)
        served = engine.post(f"/predictions/{model}", request)
        assert (served.status_code, served.content) == _in_process(service, request)
        assert served.headers["content-type"].startswith("application/json")
        assert engine.post(f"/predictions/{model}/1.0", request).content == served.content
        if model == "tiny":
            floats = float_scores(tiny_float_model, tiny_spec, request)
            torch.testing.assert_close(torch.tensor(served.json()["scores"]), floats, atol=QUANTIZATION_TOLERANCE, rtol=0)


def test_bad_input_is_a_400_naming_the_field_and_spares_the_batch(engine, store, tiny_spec):
    """Every bad request of the decoder's tests, each beside a good one in the same burst: the
    in-process answer to it alone, byte for byte; the good ones scored."""
    service = store["services"]["tiny"]
    good = items_request(tiny_spec, 2, seed=7)
    cases = [(body if isinstance(body, bytes) else json.dumps(body), "application/json", None)
             for body, _, _ in BAD_REQUESTS]
    cases += [
        (json.dumps(good), "application/x-www-form-urlencoded", None),  # what curl -d sends
        (b"not gzip", "application/json", "gzip"),
        (gzip.compress(json.dumps(good).encode()), "application/json", "gzip"),  # scored
    ]
    mixed = [case for bad in cases for case in (bad, (json.dumps(good), "application/json", None))]

    def send(case):
        body, content_type, encoding = case
        headers = {"Content-Type": content_type, **({"Content-Encoding": encoding} if encoding else {})}
        return engine.post("/predictions/tiny", body, headers=headers)

    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(send, mixed))
    for (body, content_type, encoding), served in zip(mixed, answers):
        assert (served.status_code, served.content) == _in_process(service, body, content_type, encoding), body
        if served.status_code == 400:
            assert served.json()["field"], served.text
    assert sum(a.status_code == 400 for a in answers) >= len(BAD_REQUESTS)
    assert engine.alive()


def test_a_missing_or_wrong_key_is_refused_on_every_keyed_route(engine, tiny_spec):
    """As TorchServe's token authorization answers: 400 InvalidKeyException; an inference key
    opens no management route."""
    body = json.dumps(items_request(tiny_spec, 1, seed=1))
    inference = [f"{engine.url}{path}" for path in ("/predictions/tiny", "/predictions/tiny/1.0",
                                                     "/v2/models/tiny/infer", "/predictions/nope")]
    for url in inference:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": engine.key}):
            response = requests.post(url, data=body, headers=headers, timeout=30)
            assert response.status_code == 400, (url, headers, response.text)
            assert response.json()["type"] == "InvalidKeyException"
            assert "Token Authorization failed" in response.json()["message"]
    for headers in ({}, engine.auth):
        refused = requests.get(f"{engine.management_url}/models", headers=headers, timeout=30)
        assert (refused.status_code, refused.json()["type"]) == (400, "InvalidKeyException"), refused.text


def test_a_body_over_the_limit_is_a_413_naming_the_limit(engine, store):
    body = b'{"items": [' + b" " * (7 * 2**20) + b"]}"
    response = engine.post("/predictions/tiny", body)
    assert response.status_code == 413
    assert "limits.max_request_bytes" in response.json()["message"]
    assert engine.alive()


def _scores(answer: requests.Response) -> list[float]:
    assert answer.status_code == 200, answer.text
    return answer.json()["scores"]


def _freshness_when(engine: Engine, done, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while not done(state := engine.manage("GET", "/freshness/tiny").json()):
        assert not state.get("error") and time.monotonic() < deadline, f"freshness state not reached: {state}"
        time.sleep(0.1)
    return state


CHECKS = 4  # requests whose scores each delta test compares, on every process


def _expected(store: dict, service: str, tiny_spec) -> list[bytes]:
    checks = [items_request(tiny_spec, 4, seed=s, max_bag=3) for s in range(CHECKS)]
    return [_in_process(store["services"][service], r)[1] for r in checks]


def _served_everywhere(engine: Engine, tiny_spec) -> list[bytes]:
    """The answers to the check requests, each sent three times (either process may answer): the
    same bytes each time."""
    checks = [items_request(tiny_spec, 4, seed=s, max_bag=3) for s in range(CHECKS)]
    answers = [[engine.post("/predictions/tiny", r) for _ in range(3)] for r in checks]
    assert all(len({a.content for a in sent}) == 1 for sent in answers), [[a.text for a in s] for s in answers]
    return [sent[0].content for sent in answers]


def _published_under_load(engine: Engine, tiny_spec, delta: str, done) -> dict:
    """``delta`` published while an open loop runs; the state once ``done(state)``; every request 200."""
    traffic = TrafficModel(items_per_request=1).generate(tiny_spec, 64, seed=1)
    with BackgroundLoad(f"{engine.url}/predictions/tiny", engine.auth, traffic, rate=60) as load:
        time.sleep(0.5)
        published = engine.manage("POST", "/freshness/tiny", delta=delta)
        assert published.status_code == 200, published.text
        assert published.json()["sequence"] == 1 and not published.json()["duplicate"]
        state = _freshness_when(engine, done)
        time.sleep(0.3)
    assert load.result.statuses == {"200": load.result.requests}, load.result.statuses
    return state


def _rolled_back(engine: Engine) -> dict:
    rolled = engine.manage("POST", "/freshness/tiny", rollback_to=0)
    assert rolled.status_code == 200, rolled.text
    return _freshness_when(engine, lambda s: s["applied_sequence"] == 0 and s.get("rolling_back_to") is None
                           and all(w["dense_sequence"] == 0 for w in s["workers"]))


def test_a_delta_published_under_load_reaches_every_worker_with_no_failed_request(engine, store, tiny_spec):
    """Rows published while an open loop runs: every request answered 200; then every process
    serves a fresh build's scores; a rollback brings the base's back."""
    assert _served_everywhere(engine, tiny_spec) == _expected(store, "tiny", tiny_spec)
    state = _published_under_load(engine, tiny_spec, "tiny-1.delta", lambda s: s["applied_sequence"] == 1)
    assert state["log_head"] == 1 and state["rows_applied"] > 0
    assert len(state["workers"]) == WORKERS and all(w["applied_sequence"] == 1 for w in state["workers"]), state
    assert _served_everywhere(engine, tiny_spec) == _expected(store, "fresh", tiny_spec)
    _rolled_back(engine)
    assert _served_everywhere(engine, tiny_spec) == _expected(store, "tiny", tiny_spec)


def test_dense_weights_swap_whole_in_every_worker_with_no_failed_request(engine, store, tiny_spec):
    """A delta of rows and dense weights: each process swaps its dense layers between forwards;
    every process then serves a fresh build's scores; a rollback swaps the archive's own back."""
    state = _published_under_load(engine, tiny_spec, "dense-1.delta",
                                  lambda s: [w["dense_sequence"] for w in s["workers"]] == [1] * WORKERS)
    assert all(w["dense_swap_s"] is not None for w in state["workers"]), state
    assert _served_everywhere(engine, tiny_spec) == _expected(store, "fresh_dense", tiny_spec)
    _rolled_back(engine)
    assert _served_everywhere(engine, tiny_spec) == _expected(store, "tiny", tiny_spec)


def test_no_response_mixes_two_versions_of_a_row(engine, store):
    """Every row of t_user flips between two patterns, delta after delta, while requests whose
    score depends on one t_user row alone keep coming: each score must be one of the two."""
    layout: TablesLayout = store["layout"]
    table = layout.table("t_user")
    patterns = [20 * torch.linspace(-1, 1, table.dim), 20 * torch.linspace(0.9, -0.7, table.dim)]
    rows = [np.repeat(served_rows(p[None, :], table), table.rows, axis=0) for p in patterns]
    ids = np.arange(table.rows)

    def publish(sequence: int) -> None:
        name = f"torn-{engine.kind}-{sequence}.delta"
        with DeltaWriter(store["store"] / "deltas" / name, model="tiny", base=layout.fingerprint, sequence=sequence) as out:
            out.add(table, ids, rows[sequence % 2])
        assert engine.manage("POST", "/freshness/tiny", delta=name).status_code == 200
        _freshness_when(engine, lambda s: s["applied_sequence"] == sequence)

    request = {"items": [{"dense": [0.1, 0.2, 0.3, 0.4], "sparse": {"user_id": [17]}}]}
    expected = []
    for sequence in (1, 2):
        publish(sequence)
        expected.append(_scores(engine.post("/predictions/tiny", request))[0])
    assert abs(expected[0] - expected[1]) > 1e-4  # scores apart; a mixed row scores neither
    scores, stop = [], threading.Event()

    def score() -> None:
        while not stop.is_set():
            scores.append(_scores(engine.post("/predictions/tiny", request))[0])

    senders = [threading.Thread(target=score) for _ in range(WORKERS)]  # both processes read while rows change
    for sender in senders:
        sender.start()
    for sequence in range(3, 23):
        publish(sequence)
    stop.set()
    for sender in senders:
        sender.join()
    assert len(scores) > 20
    torn = [s for s in scores if min(abs(s - e) for e in expected) > 1e-6]
    assert not torn, torn[:5]
    _rolled_back(engine)


def test_a_killed_worker_is_replaced_and_only_its_requests_fail(engine, tiny_spec):
    """SIGKILL to one of the model's two processes under an open loop: the requests it held fail
    (a connection reset on the ASGI engine, whose processes own the connections; TorchServe's
    frontend answers for its worker, "Worker died.": a 500, or the plugin's 507 where TorchServe
    read the exit as out of memory; none waits for the client's timeout, as the batch a killed
    worker was collecting did, one kill in three, before the plugin answered it), every other
    request is answered 200, and a new process takes its place."""
    before = serving_processes(engine, "tiny", WORKERS)
    traffic = TrafficModel(items_per_request=1).generate(tiny_spec, 64, seed=2)
    with BackgroundLoad(f"{engine.url}/predictions/tiny", engine.auth, traffic, rate=60) as load:
        time.sleep(0.5)
        os.kill(before[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while before[0] in (after := worker_pids(engine, "tiny")) or len(after) != WORKERS:
            assert time.monotonic() < deadline, f"no process in place of {before[0]}: {after}"
            time.sleep(0.25)
        time.sleep(0.5)
    statuses = dict(load.result.statuses)
    ok = statuses.pop("200", 0)
    assert sum(statuses.values()) <= BATCH_SIZE and set(statuses) <= {"connection_error", "500", "507"}, load.result.statuses
    assert ok + sum(statuses.values()) == load.result.requests
    assert _scores(engine.post("/predictions/tiny", items_request(tiny_spec, 2, seed=3))) and engine.alive()
