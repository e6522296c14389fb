"""The two engines behind one face, for the tests that check serving behaviour on both: TorchServe
(``LocalTorchServe``, the archives registered through its management API) and the ASGI engine
(``torchrec-serve serve --engine asgi`` in a subprocess). Each serves the archives of a model
store on free loopback ports with keys on, ``workers`` processes a model, until ``stop()``.

    server = start_engine("asgi", store, ["tiny.mar"], workers=2, workdir=tmp)
    server.post("/predictions/tiny", request)           # the inference key sent
    server.manage("POST", "/freshness/tiny", delta="tiny-1.delta")   # the management key
    server.counters("tiny").batches                    # {requests in a batch: batches}, all workers
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import requests

from archive_tools.local_asgi import LocalAsgiServer
from archive_tools.local_server import HandlerCounters, LocalTorchServe

ENGINES = ("torchserve", "asgi")


class AsgiServer(LocalAsgiServer):
    """The asgi engine, started: ``LocalAsgiServer`` with ``TorchServeEngine``'s face."""

    kind = "asgi"

    def __init__(self, store: Path, archives: list[str], workers: int, workdir: Path) -> None:
        super().__init__(store, archives, workers, workdir)
        self.start()

    @property
    def management_url(self) -> str:
        return self.url  # one port serves both


class TorchServeEngine:
    """TorchServe with the project's configuration, each archive registered with ``workers`` workers."""

    kind = "torchserve"

    def __init__(self, store: Path, archives: list[str], workers: int) -> None:
        self.server = LocalTorchServe(model_store=store)
        self.server.start()
        try:
            for archive in archives:
                registered = self.server.register(archive, initial_workers=workers)
                assert registered.status_code == 200, registered.text
        except BaseException:
            self.server.stop()
            raise
        self.url = self.server.inference_url
        self.management_url = self.server.management_url

    @property
    def key(self) -> str:
        return self.auth["Authorization"].removeprefix("Bearer ")

    @property
    def auth(self) -> dict[str, str]:
        return self.server.auth("inference")

    def post(self, path: str, body: bytes | str | dict, headers: dict | None = None, auth: bool = True) -> requests.Response:
        return _post(self.url, path, body, self.auth if auth else {}, headers)

    def manage(self, method: str, path: str, **params) -> requests.Response:
        return self.server.management(method, path, params=params, timeout=150)

    def counters(self, model: str) -> HandlerCounters:
        return self.server.handler_counters(model)

    def alive(self) -> bool:
        return self.server.process is not None and self.server.process.poll() is None

    def stop(self) -> None:
        self.server.stop()


Engine = AsgiServer | TorchServeEngine


def stop_leaving_nothing(server: AsgiServer) -> None:
    """Stops the asgi engine (SIGTERM to its processes) and checks that what it made in its
    temporary folder went with it: the models' placed archives, the processes' metric files
    (torch's own Inductor cache folder, shared by every process of the machine, may stay)."""
    server.stop()
    # one process ends by the signal it was sent (143, as a shell says); a supervisor of several, 0
    assert server.process.returncode in (0, 128 + signal.SIGTERM), server.log_tail()
    left = sorted(p.name for p in server.temporary_folder.iterdir()
                  if not p.name.startswith("torchinductor_"))
    assert left == [], left


def start_engine(kind: str, store: Path, archives: list[str], workers: int, workdir: Path) -> Engine:
    if kind == "asgi":
        return AsgiServer(store, archives, workers, workdir)
    assert kind == "torchserve", kind
    return TorchServeEngine(store, archives, workers)


def worker_pids(server: Engine, model: str) -> list[int]:
    """The pids of the processes serving ``model`` (its describe call, on either engine)."""
    described = server.manage("GET", f"/models/{model}")
    assert described.status_code == 200, described.text
    return sorted(w["pid"] for w in described.json()[0]["workers"] if w.get("pid"))


def serving_processes(server: Engine, model: str, count: int, timeout_s: float = 120) -> list[int]:
    """The pids of ``model``'s processes once there are ``count`` of them (a process restarting,
    or still loading, is not one)."""
    deadline = time.monotonic() + timeout_s
    while len(pids := worker_pids(server, model)) != count:
        assert time.monotonic() < deadline, f"not {count} processes in {timeout_s} s: {pids}"
        time.sleep(0.25)
    return pids


def _post(url: str, path: str, body: bytes | str | dict, auth: dict, headers: dict | None) -> requests.Response:
    data = json.dumps(body) if isinstance(body, dict) else body
    sent = {"Content-Type": "application/json", **auth, **(headers or {})}
    return requests.post(f"{url}{path}", data=data, headers=sent, timeout=60)
