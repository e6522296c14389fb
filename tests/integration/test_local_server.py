"""The local TorchServe harness never leaves a server behind, even when starting it fails."""

import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import requests

from archive_tools.cli import main
from archive_tools.keys import TokenKeys
from archive_tools.local_server import VMARGS_ENV, LocalTorchServe, PortTaken, ServerDied
from archive_tools.resources import config_dir

pytestmark = pytest.mark.integration


def test_start_timeout_stops_the_server(tmp_path):
    server = LocalTorchServe(model_store=tmp_path, startup_timeout_s=0.01)
    with pytest.raises(ServerDied, match="not healthy"):
        server.start()
    assert server.process is not None and server.process.poll() is not None, "server left running"


def test_unexpected_error_while_starting_stops_the_server(tmp_path, monkeypatch):
    server = LocalTorchServe(model_store=tmp_path)

    def broken_keys(*args, **kwargs):
        raise RuntimeError("key file unreadable")

    monkeypatch.setattr("archive_tools.local_server.TokenKeys", broken_keys)
    with pytest.raises(RuntimeError, match="key file unreadable"):
        server.start()
    assert server.process is not None and server.process.poll() is not None, "server left running"


def test_two_local_servers_run_side_by_side(tmp_path, monkeypatch):
    """Each server has its own working directory (pid file, keys, logs) and free ports; the
    environment's extra JVM flags reach the frontend after the config's."""
    monkeypatch.setenv(VMARGS_ENV, "-XX:TieredStopAtLevel=1 -Dtorchrec_serve.probe=yes")
    with LocalTorchServe(model_store=tmp_path) as first, LocalTorchServe(model_store=tmp_path) as second:
        assert first.workdir != second.workdir and set(first.ports.values()).isdisjoint(second.ports.values())
        for server in (first, second):
            assert requests.get(f"{server.inference_url}/ping", headers=server.auth("inference"), timeout=10).ok
            java = next(p for p in psutil.Process(server.process.pid).children(recursive=True) if p.name() == "java")
            flags = java.cmdline()
            assert {"-XX:TieredStopAtLevel=1", "-Dtorchrec_serve.probe=yes", "-Dlog4j.configurationFile="
                    f"{config_dir() / 'log4j2.xml'}", f"-Djava.io.tmpdir={server.workdir / 'tmp'}"} <= set(flags), flags


def test_kept_logs_leave_out_the_servers_temporary_folder(tmp_path):
    """Where the workers' sockets and the unpacked archives are: a socket cannot be copied."""
    store, kept = tmp_path / "store", tmp_path / "kept"
    store.mkdir()
    with LocalTorchServe(model_store=store, keep_logs=kept) as server:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(server.workdir / "tmp" / "worker.sock"))
    listener.close()
    assert (kept / "logs" / "ts_log.log").stat().st_size > 0 and (kept / "config.properties").exists()
    assert not (kept / "tmp").exists() and not server.workdir.exists()


def test_a_configured_port_that_is_taken_is_named(tmp_path, capsys):
    """``torchrec-serve serve`` on the config's ports says which port is taken, and exits 6."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = (config_dir() / "config.properties").read_text()
        config = re.sub(r"^inference_address=.*$", f"inference_address=http://127.0.0.1:{port}", config, flags=re.M)
        (tmp_path / "config.properties").write_text(config)
        with pytest.raises(PortTaken, match=f"port {port} \\(inference_address in .*\\) is taken"):
            LocalTorchServe(model_store=tmp_path, config=tmp_path / "config.properties", free_ports=False)
        code = main(["serve", "--model-store", str(tmp_path), "--config", str(tmp_path / "config.properties")])
    assert code == 6
    assert f"port {port} (inference_address" in capsys.readouterr().err


def test_keys_are_refreshed_before_they_expire_and_after_another_client_refreshed(tmp_path):
    """Keys that live 3 s, used for 9 s by two clients sharing the key file: a refresh by one
    invalidates the key the other holds, which then takes the new one from the file."""
    with LocalTorchServe(model_store=tmp_path, settings={"token_expiration_min": "0.05"}) as server:
        other = TokenKeys(server.workdir / "key_file.json", server.management_url)
        statuses = []
        deadline = time.monotonic() + 9
        while time.monotonic() < deadline:
            statuses.append(server.management("GET", "/models").status_code)
            used = other.key("management")
            response = requests.get(f"{server.management_url}/models", headers=other.header("management"), timeout=10)
            if TokenKeys.rejected(response):
                other.recover("management", used)
                response = requests.get(
                    f"{server.management_url}/models", headers=other.header("management"), timeout=10
                )
            statuses.append(response.status_code)
            time.sleep(0.1)
        assert set(statuses) == {200}, statuses
        assert server.keys.refreshes + other.refreshes >= 2


def test_dev_config_differs_only_in_token_authorization():
    def settings(name: str) -> dict[str, str]:
        lines = (config_dir() / name).read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))

    production, dev = settings("config.properties"), settings("config.dev.properties")
    assert {k for k in production if production[k] != dev.get(k)} == {"disable_token_authorization"}
    assert production["disable_token_authorization"] == "false" and dev["disable_token_authorization"] == "true"
    assert set(production) == set(dev)


def test_serve_stopped_by_sigterm_stops_its_server(tmp_path):
    """A process manager stops ``torchrec-serve serve`` with SIGTERM: the server goes with it."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "archive_tools", "serve", "--model-store", str(tmp_path), "--free-ports"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        first = serve.stdout.readline()
        port = int(re.search(r"inference http://127\.0\.0\.1:(\d+)", first).group(1))
        while "serving" not in serve.stdout.readline():
            pass
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 143
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if serve.poll() is None:
            serve.kill()
