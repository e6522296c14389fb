"""Publishing deltas to a real TorchServe through the project's plugin: rows applied in place
under load with no failed request, bad deltas refused with nothing applied, the log replayed by
new workers and by a restarted server."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.delta import DeltaSource, make_delta
from archive_tools.local_server import LocalTorchServe
from benchmarks.load import BackgroundLoad
from benchmarks.traffic import TrafficModel
from handlers.modeling.registry import load_spec
from handlers.runtime.artifacts import Artifact
from handlers.runtime.freshness.shared_tables import ROOTS, sweep
from tests.conftest import TINY_SPEC
from tests.helpers import archive_service, items_request
from tests.integration.publishing_archives import build, build_paced, checkpoints, damaged, flip_first_row_byte, newer_dense

pytestmark = pytest.mark.integration

SPEC = load_spec(TINY_SPEC)
REQUESTS = [items_request(SPEC, 4, seed=s, max_bag=3) for s in range(4)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("freshness")
    base, newer = checkpoints(root)
    store = root / "model_store"
    for artifact in (Artifact.EAGER, Artifact.AOTI, Artifact.EXPORTED):
        build(base, store, f"tiny_{artifact.value}", artifact)
    fresh = build(newer, root / "fresh", "tiny", Artifact.EAGER)  # what a full rebuild serves
    deltas = store / "deltas"
    deltas.mkdir()
    for artifact in (Artifact.EAGER, Artifact.AOTI):
        make_delta(store / f"tiny_{artifact.value}.mar", DeltaSource(checkpoint=newer),
                   deltas / f"{artifact.value}-1.delta", sequence=1)
    make_delta(fresh, DeltaSource(checkpoint=base), deltas / "other-base-1.delta", sequence=1)
    make_delta(store / "tiny_eager.mar", DeltaSource(checkpoint=newer), deltas / "eager-2.delta", sequence=2)
    newest = newer_dense(newer)
    make_delta(store / "tiny_aoti.mar", DeltaSource(checkpoint=newest, dense=newest), deltas / "dense-1.delta",
               sequence=1, name="tiny_dense")
    fresh_dense = build(newest, root / "fresh_dense", "tiny", Artifact.EAGER)
    expected = {
        "old": _scores(archive_service(store / "tiny_eager.mar")),
        "new": _scores(archive_service(fresh)),
        "dense": _scores(archive_service(fresh_dense)),
    }
    assert expected["old"] != pytest.approx(expected["new"], abs=1e-4)
    assert expected["new"] != pytest.approx(expected["dense"], abs=1e-4)
    return {"root": root, "store": store, "deltas": deltas, "expected": expected, "newer": newer}


def _scores(service) -> list[float]:
    """Every request's scores, in one list."""
    return [x for r in REQUESTS for x in json.loads(service.handle([json.dumps(r).encode()]).responses[0].body)["scores"]]


def _served(server: LocalTorchServe, model: str) -> list[float]:
    answers = [server.predict(model, r) for r in REQUESTS]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [x for a in answers for x in a.json()["scores"]]


def _policies(pid: int) -> dict[str, int]:
    """A worker's main thread's scheduling policy, and how many of its other threads run SCHED_IDLE."""
    threads = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    return {"main": os.sched_getscheduler(pid),
            "others_idle": sum(os.sched_getscheduler(t) == os.SCHED_IDLE for t in threads)}


def _publish(server: LocalTorchServe, model: str, delta: str):
    return server.management("POST", f"/freshness/{model}", params={"delta": delta})


def _applied(server: LocalTorchServe, model: str, sequence: int, timeout_s: float = 30) -> dict:
    return server.freshness_when(model, lambda state: state["applied_sequence"] >= sequence, timeout_s)


@pytest.fixture(scope="module")
def server(setup):
    with LocalTorchServe(model_store=setup["store"]) as server:
        for artifact in ("eager", "aoti", "exported"):
            assert server.register(f"tiny_{artifact}.mar").status_code == 200
        yield server


@pytest.mark.parametrize("artifact", ["eager", "aoti"])
def test_a_delta_published_under_load_moves_scores_with_no_failed_request(setup, server, artifact):
    model = f"tiny_{artifact}"
    assert _served(server, model) == pytest.approx(setup["expected"]["old"], abs=1e-6)
    traffic = TrafficModel(items_per_request=1).generate(SPEC, 64, seed=1)
    url = f"{server.inference_url}/predictions/{model}"
    with BackgroundLoad(url, server.auth("inference"), traffic, rate=100) as load:
        time.sleep(0.5)
        published = _publish(server, model, f"{artifact}-1.delta")
        assert published.status_code == 200, published.text
        assert published.json()["sequence"] == 1 and not published.json()["duplicate"]
        state = _applied(server, model, 1)
        time.sleep(0.3)
    assert load.result.statuses == {"200": load.result.requests}, load.result.statuses
    assert state["log_head"] == 1 and state["rows_applied"] > 0
    assert all(w["applied_sequence"] == 1 for w in state["workers"])
    assert _served(server, model) == pytest.approx(setup["expected"]["new"], abs=1e-6)

    again = _publish(server, model, f"{artifact}-1.delta")  # idempotent
    assert again.status_code == 200 and again.json()["duplicate"], again.text
    assert _applied(server, model, 1)["rows_applied"] == state["rows_applied"]


def _rolled_back(server: LocalTorchServe, model: str, timeout_s: float = 30) -> dict:
    """The state once a rollback asked for is done."""
    return server.freshness_when(model, lambda state: state.get("rolling_back_to") is None, timeout_s)  # null: left out


def _dense_served(server: LocalTorchServe, model: str, sequence: int, workers: int, timeout_s: float = 30) -> dict:
    """The state once ``workers`` workers serve the dense weights of delta ``sequence``."""
    return server.freshness_when(
        model, lambda state: [w.get("dense_sequence") for w in state["workers"]] == [sequence] * workers, timeout_s
    )


def test_dense_weights_swap_whole_in_every_worker_with_no_failed_request(setup, server):
    """A delta with rows and dense weights, on an AOTInductor package served by two workers: each
    swaps its constant buffer; scores become a fresh build's; a new worker starts with them; a
    rollback swaps the archive's own back."""
    model = "tiny_dense"
    assert server.register("tiny_aoti.mar", model_name=model, initial_workers=2).status_code == 200
    traffic = TrafficModel(items_per_request=1).generate(SPEC, 64, seed=2)
    with BackgroundLoad(f"{server.inference_url}/predictions/{model}", server.auth("inference"), traffic, rate=100) as load:
        time.sleep(0.5)
        published = _publish(server, model, "dense-1.delta")
        assert published.status_code == 200, published.text
        state = _dense_served(server, model, 1, workers=2)
        time.sleep(0.3)
    assert load.result.statuses == {"200": load.result.requests}, load.result.statuses
    assert all(w["dense_swap_s"] is not None for w in state["workers"])
    for _ in range(4):  # both workers answer in turn
        assert _served(server, model) == pytest.approx(setup["expected"]["dense"], abs=1e-6)

    scaled = server.management("PUT", f"/models/{model}", params={"min_worker": 3, "synchronous": "true"})
    assert scaled.status_code == 200, scaled.text
    _dense_served(server, model, 1, workers=3)
    for _ in range(6):
        assert _served(server, model) == pytest.approx(setup["expected"]["dense"], abs=1e-6)

    rolled = server.management("POST", f"/freshness/{model}", params={"rollback_to": 0})
    assert rolled.status_code == 200, rolled.text
    _dense_served(server, model, 0, workers=3)
    for _ in range(6):
        assert _served(server, model) == pytest.approx(setup["expected"]["old"], abs=1e-6)


BAD_DELTAS = [
    (lambda setup: "other-base-1.delta", 400, "delta.base"),  # made for an archive of other weights
    (lambda setup: damaged(setup, "flipped-1.delta", flip_first_row_byte, "eager-1.delta"), 400, "other contents"),
    (lambda setup: damaged(setup, "truncated.delta", lambda d: d[: len(d) // 2]), 400, "truncated"),
    (lambda setup: damaged(setup, "flipped.delta", flip_first_row_byte), 400, "xxh3_128"),
    (lambda setup: "../base.pt", 400, "paths are refused"),
    (lambda setup: "missing.delta", 404, "no 'missing.delta'"),
]


@pytest.mark.parametrize("make, status, problem", BAD_DELTAS)
def test_a_bad_delta_is_refused_by_name_and_nothing_is_applied(setup, server, make, status, problem):
    model = "tiny_eager"
    before = server.management("GET", f"/freshness/{model}").json()
    scores = _served(server, model)
    response = _publish(server, model, make(setup))
    assert response.status_code == status, response.text
    assert problem in response.text
    after = server.management("GET", f"/freshness/{model}").json()
    assert (after["log_head"], after["applied_sequence"], after["rows_applied"]) == (
        before["log_head"], before["applied_sequence"], before["rows_applied"])
    assert _served(server, model) == scores


def test_a_sequence_out_of_order_is_refused(setup, server, tmp_path):
    make_delta(setup["store"] / "tiny_eager.mar", DeltaSource(checkpoint=setup["newer"]),
               setup["deltas"] / "eager-3.delta", sequence=3)
    response = _publish(server, "tiny_eager", "eager-3.delta")
    assert response.status_code == 400 and "delta.sequence" in response.text, response.text


def test_a_model_loaded_at_the_servers_start_refuses_deltas_naming_why(setup):
    """Loaded by TorchServe itself (``load_models``), not through the plugin's /models: no delta
    log is named for it, so a publish is a 409 saying how to register it, not a wait for
    workers that will not answer."""
    with LocalTorchServe(model_store=setup["store"], settings={"load_models": "tiny_eager.mar"}) as started:
        response = _publish(started, "tiny_eager", "eager-1.delta")
    assert response.status_code == 409, response.text
    assert "POST /models" in response.json()["message"], response.text


def test_an_exported_archive_refuses_deltas_naming_its_kind(server):
    response = _publish(server, "tiny_exported", "eager-1.delta")
    assert response.status_code == 409, response.text
    assert "exported" in response.json()["message"]


def test_new_workers_and_a_restarted_server_serve_the_log(setup, server):
    """Runs after the publish test: the eager model's log holds sequence 1."""
    model = "tiny_eager"
    _applied(server, model, 1)
    scaled = server.management("PUT", f"/models/{model}", params={"min_worker": 2, "synchronous": "true"})
    assert scaled.status_code == 200, scaled.text
    for _ in range(4):  # both workers answer in turn
        assert _served(server, model) == pytest.approx(setup["expected"]["new"], abs=1e-6)
    workers = server.management("GET", f"/freshness/{model}").json()["workers"]
    assert len(workers) == 2, workers
    for worker in workers:  # the forwards at the machine's normal priority; the log follower (and its
        policies = _policies(worker["pid"])  # intra-op threads, if it made any) below it
        assert policies["main"] == os.SCHED_OTHER and policies["others_idle"] >= 1, (worker, policies)
    with LocalTorchServe(model_store=setup["store"]) as restarted:
        assert restarted.register("tiny_eager.mar").status_code == 200
        state = restarted.management("GET", f"/freshness/{model}").json()
        assert state["applied_sequence"] == 1, state  # replayed before the first request
        assert _served(restarted, model) == pytest.approx(setup["expected"]["new"], abs=1e-6)


def test_an_unzipped_archive_stays_as_built_its_copy_takes_the_deltas_and_goes_with_the_model(setup, server):
    """An unzipped archive is served from the model store itself: deltas change a working copy of
    its tables in shared memory, never the archive's files, and the copy is removed once the model
    is gone."""
    folder = build_archive(
        TINY_SPEC, checkpoint=setup["root"] / "base.pt", seed=0, name="tiny_folder", version="1.0",
        model_store=setup["store"], serving=ServingConfig(batch_size=8, max_batch_delay_ms=5),
        artifact=Artifact.EAGER, archive_format="no-archive",
    )
    built = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert server.register("tiny_folder").status_code == 200
    assert _publish(server, "tiny_folder", "eager-1.delta").status_code == 200
    state = _applied(server, "tiny_folder", 1)
    assert _served(server, "tiny_folder") == pytest.approx(setup["expected"]["new"], abs=1e-6)
    copy = Path(state["tables_file"])
    assert copy.parent.parent in ROOTS and copy.exists(), copy
    assert {name: (folder / name).read_bytes() for name in built} == built

    assert server.management("DELETE", "/models/tiny_folder").status_code == 200
    deadline = time.monotonic() + 30
    while copy.parent not in sweep() and copy.exists():  # once its workers have exited
        assert time.monotonic() < deadline, f"{copy} is still held"
        time.sleep(0.2)
    assert not copy.exists()


def test_a_rollback_restores_the_rows_and_the_log_continues_from_there(setup, server):
    """Runs after the publish test: the aoti model's log holds sequence 1."""
    model = "tiny_aoti"
    _applied(server, model, 1)
    beyond = server.management("POST", f"/freshness/{model}", params={"rollback_to": 5})
    assert beyond.status_code == 400 and "rollback_to" in beyond.text, beyond.text
    word = server.management("POST", f"/freshness/{model}", params={"rollback_to": "latest"})
    assert word.status_code == 400 and "must be a sequence number" in word.text, word.text
    rolled = server.management("POST", f"/freshness/{model}", params={"rollback_to": 0})
    assert rolled.status_code == 200 and rolled.json()["rolling_back_to"] == 0, rolled.text
    state = _rolled_back(server, model)
    assert (state["applied_sequence"], state["log_head"]) == (0, 0), state
    assert _served(server, model) == pytest.approx(setup["expected"]["old"], abs=1e-6)
    again = _publish(server, model, "aoti-1.delta")
    assert again.status_code == 200 and not again.json()["duplicate"], again.text
    _applied(server, model, 1)
    assert _served(server, model) == pytest.approx(setup["expected"]["new"], abs=1e-6)


def test_workers_killed_during_an_apply_resume_it(setup, server, tmp_path):
    """A model whose deltas are written at 200 rows/s (643 rows: about 3 s): both its workers are killed halfway through
    one; their replacements finish it from where the state file says, before they serve."""
    build_paced(setup["root"] / "base.pt", setup["store"], "tiny_slow")
    assert server.register("tiny_slow.mar", initial_workers=2).status_code == 200
    assert _publish(server, "tiny_slow", "eager-1.delta").status_code == 200

    def state() -> dict:
        return server.management("GET", "/freshness/tiny_slow").json()

    assert server.freshness_when("tiny_slow", lambda s: s["rows_applied"] >= 100)["applied_sequence"] == 0  # halfway
    victims = [w["pid"] for w in server.management("GET", "/models/tiny_slow").json()[0]["workers"]]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        workers = server.management("GET", "/models/tiny_slow").json()[0]["workers"]
        ready = [w["pid"] for w in workers if w["status"] == "READY"]
        if len(ready) == 2 and not set(ready) & set(victims):
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)
    assert state()["applied_sequence"] == 1  # finished before the new workers took requests
    assert _served(server, "tiny_slow") == pytest.approx(setup["expected"]["new"], abs=1e-6)


def test_rollbacks_restore_the_rows_a_killed_writer_and_a_writer_midway_had_kept(setup, server):
    """Runs after the test above: tiny_slow applied delta 1 in two writers, the first killed
    midway. Delta 2 (the same rows again) is published and, midway through it, a rollback to 1
    asked for: the writer finishes 2, undoes it, and delta 1's rows stay. A rollback to 0 then
    restores the archive's rows from the undo that the killed writer began."""
    model = "tiny_slow"
    assert _publish(server, model, "eager-2.delta").status_code == 200
    start = server.management("GET", f"/freshness/{model}").json()["rows_applied"]
    server.freshness_when(model, lambda state: state["rows_applied"] >= start + 100)
    rolled = server.management("POST", f"/freshness/{model}", params={"rollback_to": 1})
    assert rolled.status_code == 200, rolled.text
    state = _rolled_back(server, model, timeout_s=60)
    assert (state["applied_sequence"], state["log_head"], state.get("error")) == (1, 1, None), state
    assert _served(server, model) == pytest.approx(setup["expected"]["new"], abs=1e-6)
    assert server.management("POST", f"/freshness/{model}", params={"rollback_to": 0}).status_code == 200
    state = _rolled_back(server, model, timeout_s=60)
    assert (state["applied_sequence"], state["log_head"], state.get("error")) == (0, 0, None), state
    assert _served(server, model) == pytest.approx(setup["expected"]["old"], abs=1e-6)
