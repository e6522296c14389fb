"""A local TorchServe for the demo, the tests and benchmarks: our config, free loopback ports.

    with LocalTorchServe(model_store=Path("model_store")) as server:
        server.register("tiny.mar", batch_size=32, max_batch_delay=5)
        server.predict("tiny", body)          # -> requests.Response

The server runs in its own process group (Java frontend + Python workers) inside a private working
directory, where TorchServe writes ``key_file.json`` and its logs. It is always stopped by pid on exit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

import requests
from prometheus_client.parser import text_string_to_metric_families

from archive_tools.keys import TokenKeys
from archive_tools.plugin import plugin_dir
from archive_tools.process_group import stop_group
from archive_tools.resources import config_dir
from handlers.runtime.errors import InputError
from handlers.runtime.freshness.shared_tables import sweep

VMARGS_ENV = "TORCHREC_SERVE_VMARGS"  # more JVM flags for the frontend, after the config's

_PORT_KEYS = {
    "inference_address": "http://127.0.0.1:{}",
    "management_address": "http://127.0.0.1:{}",
    "metrics_address": "http://127.0.0.1:{}",
    "grpc_inference_port": "{}",
    "grpc_management_port": "{}",
}


@dataclasses.dataclass(frozen=True)
class HandlerCounters:
    """Our handler's counters for one model (see ``handlers.torchserve_handler``), all workers.

    ``batches``: {requests in a TorchServe batch: how many such batches}; ``forward_ms``: the
    time the workers spent in forwards (``HandlerStageMilliseconds{Stage="forward"}``).
    """

    batches: dict[int, int]
    forwards: int
    forward_items: int
    forward_ms: float = 0.0

    def minus(self, earlier: "HandlerCounters") -> "HandlerCounters":
        """What happened between ``earlier`` and these counters."""
        batches = {k: v - earlier.batches.get(k, 0) for k, v in self.batches.items()}
        return HandlerCounters(
            batches={k: v for k, v in batches.items() if v},
            forwards=self.forwards - earlier.forwards,
            forward_items=self.forward_items - earlier.forward_items,
            forward_ms=self.forward_ms - earlier.forward_ms,
        )

    @classmethod
    def from_metrics(cls, text: str, model: str) -> "HandlerCounters":
        """The counters in a Prometheus text exposition (either engine's: the same names and
        ``ModelName`` label), summed over the workers."""
        batches: dict[int, int] = {}
        totals = {"HandlerForwards": 0, "HandlerForwardItems": 0}
        forward_ms = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("ModelName") != model:
                    continue
                name = family.name
                if name == "HandlerBatches":
                    size = int(sample.labels["Requests"])
                    batches[size] = batches.get(size, 0) + int(sample.value)
                elif name in totals:
                    totals[name] += int(sample.value)
                elif name == "HandlerStageMilliseconds" and sample.labels.get("Stage") == "forward":
                    forward_ms += sample.value
        return cls(batches, totals["HandlerForwards"], totals["HandlerForwardItems"], forward_ms)

    @property
    def requests(self) -> int:
        return sum(size * count for size, count in self.batches.items())

    @property
    def mean_requests_per_batch(self) -> float:
        return self.requests / max(1, sum(self.batches.values()))

    @property
    def mean_items_per_forward(self) -> float:
        return self.forward_items / max(1, self.forwards)


class ServerDied(RuntimeError):
    """TorchServe exited while starting or serving; the message holds the end of its log."""


class PortTaken(RuntimeError):
    """A port the configuration names is in use by another process."""


class LocalTorchServe:
    """``free_ports``: each listener on a free loopback port (tests, benchmarks, several servers on
    one machine); else on the ports ``config`` names, refused clearly when one is taken.
    ``settings`` replace or add config.properties keys (e.g. ``{"token_expiration_min": "0.1"}``);
    the environment's ``TORCHREC_SERVE_VMARGS`` is added to the frontend's JVM flags (the test
    suite's servers live seconds: it sets ``-XX:TieredStopAtLevel=1``, a third less JIT CPU).

    Its calls authenticate with keys that stay valid (``archive_tools.keys.TokenKeys``): refreshed
    before they expire, and a call refused for its key is retried once with a fresh one."""

    def __init__(
        self,
        model_store: Path,
        config: Path | None = None,
        startup_timeout_s: float = 120.0,
        keep_logs: Path | None = None,
        free_ports: bool = True,
        settings: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model_store = Path(model_store).resolve()
        self.base_config = config or config_dir() / "config.properties"
        self.startup_timeout_s = startup_timeout_s
        self.keep_logs = keep_logs
        self.ports = (
            {key: free_port() for key in _PORT_KEYS}
            if free_ports
            else _configured_ports(self.base_config)
        )
        self.settings = dict(settings or {})
        self.env = dict(env or {})  # added to the server's environment (its workers inherit it)
        self.workdir = Path(tempfile.mkdtemp(prefix="torchserve-"))
        self.process: subprocess.Popen | None = None
        self._log: BinaryIO | None = None
        self.keys: TokenKeys | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> "LocalTorchServe":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        """Starts the server and waits until it is healthy; after ``stop()`` it starts again on
        the same ports (a restarted host)."""
        self.workdir.mkdir(exist_ok=True)
        config_path = self.workdir / "config.properties"
        config_path.write_text(self._config_text())
        (self.workdir / "tmp").mkdir()
        env = {**os.environ, **self.env}
        env["TMPDIR"] = str(self.workdir / "tmp")  # the launcher's pid file lives there
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["LOG_LOCATION"] = str(self.workdir / "logs")
        env["METRICS_LOCATION"] = str(self.workdir / "logs")
        self._log = open(self.workdir / "torchserve.out", "wb")
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "ts.model_server",  # the torchserve command
                "--start",
                "--foreground",
                "--ncs",
                "--ts-config", str(config_path),
                "--model-store", str(self.model_store),
            ],
            cwd=self.workdir,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_healthy()
        except BaseException:  # never leave a server behind when starting fails, however it fails
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            self.keys = TokenKeys(self.workdir / "key_file.json", self.management_url)
            try:
                ping = requests.get(f"{self.inference_url}/ping", headers=self.auth("inference"), timeout=2)
                if ping.status_code == 200:
                    return
            except requests.RequestException:  # not listening yet, or too busy to answer in time
                pass
            time.sleep(0.5)
        raise ServerDied(
            f"TorchServe not healthy after {self.startup_timeout_s}s:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Kills the server's process group (launcher, Java frontend, workers) by its pid, workers
        first (``archive_tools.process_group``)."""
        if self.process is not None and self.process.poll() is None:
            stop_group(self.process)
            sweep()  # the working copies of tables its workers served (shared memory)
        if self._log is not None:
            self._log.close()
        if self.keep_logs is not None and self.workdir.exists():
            # not tmp/: the unpacked archives (GiBs) and the workers' sockets
            shutil.copytree(self.workdir, self.keep_logs, dirs_exist_ok=True,
                            ignore=lambda folder, names: ["tmp"] if Path(folder) == self.workdir else [])
        shutil.rmtree(self.workdir, ignore_errors=True)

    def check_alive(self) -> None:
        if self.process is None or self.process.poll() is not None:
            raise ServerDied(f"TorchServe exited:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        logs = [self.workdir / "torchserve.out", self.workdir / "logs" / "model_log.log"]
        text = []
        for path in logs:
            if path.exists():
                text.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(text)

    # -- endpoints -----------------------------------------------------------------------------

    @property
    def inference_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['inference_address']}"

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['management_address']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics_address']}"

    def auth(self, api: str) -> dict[str, str]:
        """The Authorization header for ``api`` ("inference" or "management"), if tokens are on."""
        return self.keys.header(api) if self.keys is not None else {}

    def call(self, api: str, method: str, url: str, **kwargs: Any) -> requests.Response:
        """One HTTP call with ``api``'s key; refused for its key (expired, or refreshed by another
        client), it is retried once with a fresh key."""
        headers = dict(kwargs.pop("headers", {}))
        for attempt in range(2):
            auth = self.auth(api)
            response = requests.request(method, url, headers={**headers, **auth}, **kwargs)
            if attempt == 0 and self.keys is not None and TokenKeys.rejected(response):
                self.keys.recover(api, auth.get("Authorization", " ").split(" ")[-1])
                continue
            return response
        return response

    def register(self, url: str, *, timeout_s: float = 300.0, **params: Any) -> requests.Response:
        """POST /models?url=...&synchronous=true; ``params`` are batch_size, initial_workers, ..."""
        query = {"url": url, "synchronous": "true", "initial_workers": 1, **params}
        return self.call("management", "POST", f"{self.management_url}/models", params=query, timeout=timeout_s)

    def management(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", 300)
        return self.call("management", method, f"{self.management_url}{path}", **kwargs)

    def freshness_when(self, model: str, done: Callable[[dict], bool], timeout_s: float = 30.0) -> dict:
        """The model's ``GET /freshness`` state once ``done(state)`` holds (asked every 100 ms: an
        ask costs the frontend 10 ms of CPU, taken from what is waited for); ``AssertionError``
        with the last state if it reports an error first, or at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.management("GET", f"/freshness/{model}").json()
            if done(state):
                return state
            if state.get("error") or time.monotonic() > deadline:
                raise AssertionError(f"{model}: freshness state not reached within {timeout_s} s: {state}")
            time.sleep(0.1)

    def flush_metrics(self, model: str) -> None:
        """Has the model's worker publish the counts it has summed (its describe call does)."""
        self.management("GET", f"/models/{model}", params={"customized": "true"}).raise_for_status()

    def scrape(self, model: str) -> str:
        """The Prometheus metrics text, with ``model``'s worker's counts up to now: its counts are
        flushed, then scraped until three scrapes 0.1 s apart agree on the model's lines (the
        frontend reads the worker's metric lines on a thread of its own; its own host counters,
        ``Requests2XX`` among them, count every scrape, so the whole text never agrees)."""
        self.flush_metrics(model)
        text, seen = "", []
        label = f'ModelName="{model}"'
        for _ in range(30):
            text = requests.get(f"{self.metrics_url}/metrics", timeout=30).text
            seen.append([line for line in text.splitlines() if label in line])
            if len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]:  # unchanged for 0.2 s
                break
            time.sleep(0.1)
        return text

    def handler_counters(self, model: str) -> HandlerCounters:
        """Reads our handler's counters for ``model`` from the Prometheus metrics API, exact up
        to now."""
        return HandlerCounters.from_metrics(self.scrape(model), model)

    def predict(
        self, model: str, body: bytes | str | dict, version: str | None = None, timeout_s: float = 60
    ) -> requests.Response:
        path = f"/predictions/{model}" + (f"/{version}" if version else "")
        data = json.dumps(body) if isinstance(body, dict) else body
        headers = {"Content-Type": "application/json"}
        return self.call("inference", "POST", f"{self.inference_url}{path}", data=data, headers=headers, timeout=timeout_s)

    # -- helpers -------------------------------------------------------------------------------

    def _config_text(self) -> str:
        text = self.base_config.read_text()
        for key, template in _PORT_KEYS.items():
            text, count = re.subn(
                rf"^{key}=.*$", f"{key}={template.format(self.ports[key])}", text, flags=re.M
            )
            if count != 1:
                raise InputError(f"{self.base_config}: expected one '{key}=' line, found {count}")
        settings = {"model_store": str(self.model_store), **self.settings}
        if re.search(r"^plugins_path=", text, flags=re.M):
            settings.setdefault("plugins_path", str(plugin_dir()))
        # a relative log4j2.xml is the one beside the config (config/ or the installed copy)
        text = re.sub(
            r"-Dlog4j\.configurationFile=(\S+)",
            lambda m: f"-Dlog4j.configurationFile={self.base_config.parent / Path(m.group(1)).name}"
            if not Path(m.group(1)).is_absolute() else m.group(0),
            text,
        )
        for key, value in settings.items():
            text, count = re.subn(rf"^{re.escape(key)}=.*$", lambda _: f"{key}={value}", text, flags=re.M)
            if count == 0:
                text += f"\n{key}={value}\n"
        # The frontend unpacks each .mar under java.io.tmpdir/models/ and, stopped by a signal,
        # leaves it there (652 folders, 1.6 GiB in /tmp here): under the working directory, the
        # unpacked archives go with it.
        vmargs = " ".join(filter(None, [f"-Djava.io.tmpdir={self.workdir / 'tmp'}", os.environ.get(VMARGS_ENV)]))
        text, count = re.subn(r"^vmargs=(.*)$", lambda m: f"vmargs={m.group(1)} {vmargs}", text, flags=re.M)
        if count == 0:
            text += f"\nvmargs={vmargs}\n"
        return text


def _configured_ports(config: Path) -> dict[str, int]:
    """The ports ``config`` names, each checked to be free now."""
    text = config.read_text()
    ports = {}
    for key in _PORT_KEYS:
        match = re.search(rf"^{key}=(?:.*:)?(\d+)\s*$", text, flags=re.M)
        if match is None:
            raise InputError(f"{config}: no '{key}=' line with a port")
        ports[key] = int(match.group(1))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", ports[key]))
            except OSError:
                raise PortTaken(
                    f"port {ports[key]} ({key} in {config}) is taken by another process: stop it, "
                    "or start this server on free ports (--free-ports)"
                ) from None
    return ports


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
