"""A local ASGI engine for the tests and benchmarks: ``torchrec-serve serve --engine asgi`` as a
subprocess on free loopback ports (HTTP on ``url``, gRPC on ``grpc_target``: a shared gRPC port
would split a server's calls with another's), in its own process group, ready when entered,
stopped by pid.

    with LocalAsgiServer(Path("model_store"), ["tiny.mar"], workers=2) as server:
        server.post("/predictions/tiny", body)            # -> requests.Response
        server.processes("tiny", 2)                       # the pids once both processes serve

``entry``: what follows ``python -m``; by default the CLI's serve command. A benchmark passes an
entry point of its own that takes the same arguments (``benchmarks.asgi_floor``). The server's
keys and its output (``server.out``) are kept in ``workdir`` (default: a new temporary folder,
removed on stop).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import requests

from archive_tools.local_server import HandlerCounters, ServerDied, free_port

SERVE = ("archive_tools", "serve", "--engine", "asgi")


class LocalAsgiServer:
    def __init__(
        self,
        store: Path,
        archives: Sequence[str],
        workers: int = 1,
        workdir: Path | None = None,
        entry: Sequence[str] = SERVE,
        startup_timeout_s: float = 180.0,
    ) -> None:
        self.store = Path(store)
        self.archives = list(archives)
        self.workers = workers
        self.entry = tuple(entry)
        self.startup_timeout_s = startup_timeout_s
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="asgi-"))
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        self.key_file = self.workdir / "keys.json"
        self.log = self.workdir / "server.out"
        self.temporary_folder = self.workdir / "tmp"  # its TMPDIR: empty again once stopped
        self.process: subprocess.Popen | None = None
        self.keys: dict = {}  # the key file's, once started

    def __enter__(self) -> "LocalAsgiServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        """Starts the server; returns once it answers its readiness probe (its first process
        has loaded every model)."""
        command = [sys.executable, "-m", *self.entry, *self.archives, "--model-store", str(self.store),
                   "--port", str(self.port), "--grpc-port", str(self.grpc_port), "--workers", str(self.workers),
                   "--key-file", str(self.key_file)]
        self.temporary_folder.mkdir(exist_ok=True)
        environment = {**os.environ, "TMPDIR": str(self.temporary_folder)}
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env=environment, start_new_session=True)
        try:
            self._wait_ready()
            self.keys = json.loads(self.key_file.read_text())
        except BaseException:  # never leave a server behind when starting fails
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise ServerDied(f"the asgi engine exited:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.25)
        raise ServerDied(f"the asgi engine not ready in {self.startup_timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's process group (its supervisor and workers), SIGKILL after 30 s."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # start_new_session: the group is the server's pid
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    # -- calls ------------------------------------------------------------------------------------

    @property
    def key(self) -> str:
        return self.keys["inference"]["key"]

    @property
    def auth(self) -> dict[str, str]:
        """The inference key's header."""
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def management_auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys['management']['key']}"}

    def post(self, path: str, body: bytes | str | dict, headers: dict | None = None, auth: bool = True) -> requests.Response:
        data = json.dumps(body) if isinstance(body, dict) else body
        sent = {"Content-Type": "application/json", **(self.auth if auth else {}), **(headers or {})}
        return requests.post(f"{self.url}{path}", data=data, headers=sent, timeout=60)

    def manage(self, method: str, path: str, **params: Any) -> requests.Response:
        """A management call (``/models``, ``/freshness``) with the management key."""
        return requests.request(method, f"{self.url}{path}", params=params, headers=self.management_auth, timeout=150)

    def processes(self, model: str, count: int, timeout_s: float = 120) -> list[int]:
        """The pids of the live processes serving ``model`` once there are ``count`` of them."""
        deadline = time.monotonic() + timeout_s
        pids: list[int] = []
        while time.monotonic() < deadline:
            pids = [w["pid"] for w in self.manage("GET", f"/models/{model}").json()[0]["workers"]]
            if len(pids) == count:
                return pids
            time.sleep(0.25)
        raise ServerDied(f"not {count} processes serving {model} in {timeout_s} s: {pids}\n{self.log_tail()}")

    def counters(self, model: str) -> HandlerCounters:
        """The handler's counters for ``model``, summed over the processes (``/metrics``)."""
        return HandlerCounters.from_metrics(requests.get(f"{self.url}/metrics", timeout=10).text, model)

    def stats(self, model: str) -> dict[int, int]:
        """{requests in a batch: batches}, of the process that answers (the statistics route)."""
        stats = requests.get(f"{self.url}/v2/models/{model}/stats", headers=self.auth, timeout=10).json()
        return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["model_stats"][0]["batch_stats"]}
