"""The local TorchServe harness never leaves a server behind, even when starting it fails."""

import re
import socket

import pytest
import requests

from archive_tools.cli import main
from archive_tools.local_server import LocalTorchServe, PortTaken, ServerDied
from archive_tools.resources import config_dir

pytestmark = pytest.mark.integration


def test_start_timeout_stops_the_server(tmp_path):
    server = LocalTorchServe(model_store=tmp_path, startup_timeout_s=0.01)
    with pytest.raises(ServerDied, match="not healthy"):
        server.start()
    assert server.process is not None and server.process.poll() is not None, "server left running"


def test_unexpected_error_while_starting_stops_the_server(tmp_path, monkeypatch):
    server = LocalTorchServe(model_store=tmp_path)

    def broken_keys():
        raise RuntimeError("key file unreadable")

    monkeypatch.setattr(server, "_read_keys", broken_keys)
    with pytest.raises(RuntimeError, match="key file unreadable"):
        server.start()
    assert server.process is not None and server.process.poll() is not None, "server left running"


def test_two_local_servers_run_side_by_side(tmp_path):
    """Each server has its own working directory (pid file, keys, logs) and free ports."""
    with LocalTorchServe(model_store=tmp_path) as first, LocalTorchServe(model_store=tmp_path) as second:
        assert first.workdir != second.workdir and set(first.ports.values()).isdisjoint(second.ports.values())
        for server in (first, second):
            assert requests.get(f"{server.inference_url}/ping", headers=server.auth("inference"), timeout=10).ok


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
