"""What the engine's launcher reads and checks before any server process starts: the key file
(made when missing, refused by the field when malformed), the gRPC port (refused when taken) and
the settings handed to each process through the environment."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from handlers.asgi.key_file import KeyFile
from handlers.asgi.settings import ENGINE_ENV, EngineSettings, check_port_free
from handlers.runtime.errors import InputError


def test_a_missing_key_file_is_made_with_two_fresh_keys_for_its_owner_alone(tmp_path):
    keys = KeyFile(tmp_path / "keys.json")
    key = keys.key()
    written = json.loads((tmp_path / "keys.json").read_text())
    assert written["inference"]["key"] == key and keys.management_key() == written["management"]["key"] != key
    assert stat.S_IMODE(os.stat(tmp_path / "keys.json").st_mode) == 0o600
    assert KeyFile(tmp_path / "keys.json").key() == key  # an existing file is read, not replaced


@pytest.mark.parametrize("content, field", [
    ("not json", "must be JSON"),
    ('{"management": {"key": "m"}}', "must be JSON"),
    ('{"inference": {"key": ""}}', "inference.key: must be a non-empty string"),
    ('{"inference": {"key": 5}}', "inference.key: must be a non-empty string"),
])
def test_a_key_file_without_an_inference_key_is_refused_naming_the_field(tmp_path, content, field):
    (tmp_path / "keys.json").write_text(content)
    with pytest.raises(InputError, match=field):
        KeyFile(tmp_path / "keys.json").key()


def test_the_management_key_is_optional_but_never_empty(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"inference": {"key": "i"}}')
    assert KeyFile(path).management_key() is None  # the management routes are then refused
    path.write_text('{"inference": {"key": "i"}, "management": {"key": ""}}')
    with pytest.raises(InputError, match="management.key: must be a non-empty string"):
        KeyFile(path).management_key()


def test_a_grpc_port_in_use_is_refused_naming_the_option():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(InputError, match=f"--grpc-port: 127.0.0.1:{port} is in use"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again once closed


def test_settings_reach_each_process_through_the_environment(monkeypatch):
    settings = EngineSettings((Path("/a/tiny"),), Path("keys.json"), Path("store"), None, "::1", 9001)
    monkeypatch.setenv(ENGINE_ENV, settings.to_env())
    assert EngineSettings.from_env() == settings
