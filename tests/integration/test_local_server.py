"""The local TorchServe harness never leaves a server behind, even when starting it fails."""

import pytest

from archive_tools.local_server import LocalTorchServe, ServerDied

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
