"""The working copies of a model's tables under a real TorchServe: each goes once the model's last
worker is gone, however the worker ended (unregistered, scaled to zero, killed, the server
stopped), for a model of row ids and for raw-id models (MCH, ZCH). Each model's copy is made in a
folder of its own (``freshness: {tables_dir: ...}``), which the test lists."""

from __future__ import annotations

import fcntl
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from archive_tools.build import build_archive
from archive_tools.local_server import LocalTorchServe
from archive_tools.model_config import ServingConfig
from handlers.runtime.archive_files import MODEL_CONFIG
from handlers.runtime.freshness.keeper import HOLD_FILE
from tests.conftest import TINY_SPEC
from tests.integration.raw_id_models import REMAPS, raw_spec

pytestmark = pytest.mark.integration

MODELS = ("copy_plain", "copy_mch", "copy_zch")
GONE_WITHIN_S = 10.0  # a keeper removes a copy as its last worker's locks are released: at once


@pytest.fixture(scope="module")
def store(tiny_spec, tmp_path_factory) -> Path:
    """Three unzipped archives of the tiny model (row ids; every table MCH; every table ZCH), each
    with its copy's own ``tables_dir``."""
    store = tmp_path_factory.mktemp("copies")
    for name, remap in (("copy_mch", REMAPS["t_user"]), ("copy_zch", REMAPS["t_item"])):
        spec = raw_spec(tiny_spec)
        spec.replace(name=name, tables=[{**t.model_dump(mode="json"), "remap": remap} for t in spec.tables]
                     ).to_yaml(store / f"{name}.yaml")
    for name in MODELS:
        folder = build_archive(
            store / f"{name}.yaml" if name != "copy_plain" else TINY_SPEC, checkpoint=None, seed=0, name=name,
            version="1.0", model_store=store, serving=ServingConfig(batch_size=8, max_batch_delay_ms=5),
            archive_format="no-archive",
        )
        config = yaml.safe_load((folder / MODEL_CONFIG).read_text())
        config["freshness"]["tables_dir"] = str(store / "tables" / name)
        (folder / MODEL_CONFIG).write_text(yaml.safe_dump(config))
    return store


def _copies(store: Path, model: str) -> list[Path]:
    folder = store / "tables" / model
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _held(folder: Path) -> bool:
    fd = os.open(folder / HOLD_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _settled(store: Path, model: str, held: int, case: str) -> None:
    """Until the model's tables folder holds ``held`` copies, each held by a worker (a removed
    copy may take a moment to go)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while not (len(copies := _copies(store, model)) == held and all(map(_held, copies))):
        assert time.monotonic() < deadline, f"{model}: {copies} {GONE_WITHIN_S} s after {case}"
        time.sleep(0.05)


def _workers(server: LocalTorchServe, model: str) -> list[dict]:
    response = server.management("GET", f"/models/{model}")
    assert response.status_code == 200, response.text
    return response.json()[0]["workers"]


def _killed_and_restarted(server: LocalTorchServe, model: str) -> None:
    """Its worker killed (``SIGKILL``); returns once TorchServe's replacement is ready."""
    (victim,) = [w["pid"] for w in _workers(server, model)]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while [(w["status"], w["pid"] == victim) for w in _workers(server, model)] != [("READY", False)]:
        assert time.monotonic() < deadline, _workers(server, model)
        time.sleep(0.2)


def _scaled(server: LocalTorchServe, model: str, workers: int) -> None:
    params = {"min_worker": workers, "max_worker": workers, "synchronous": "true"}
    response = server.management("PUT", f"/models/{model}", params=params)
    assert response.status_code == 200, response.text


def _every_way_a_worker_ends(server: LocalTorchServe, store: Path, model: str) -> None:
    assert server.register(model).status_code == 200
    _settled(store, model, 1, "registering")
    _killed_and_restarted(server, model)  # the copy may be made again, but never left unserved
    _settled(store, model, 1, "a worker killed and restarted")
    _scaled(server, model, 0)
    _settled(store, model, 0, "scaling to zero")
    _scaled(server, model, 1)
    _settled(store, model, 1, "scaling to one")
    assert server.management("DELETE", f"/models/{model}").status_code == 200
    _settled(store, model, 0, "unregistering")
    assert server.register(model).status_code == 200
    _settled(store, model, 1, "registering again")


def test_no_copy_of_a_models_tables_outlives_its_last_worker(store):
    with LocalTorchServe(model_store=store) as server:
        with ThreadPoolExecutor(len(MODELS)) as pool:  # the models at once: their loads overlap
            for done in [pool.submit(_every_way_a_worker_ends, server, store, m) for m in MODELS]:
                done.result()
    for model in MODELS:  # the server stopped (its own sweep looks only in the default places)
        _settled(store, model, 0, "the server's stop")
