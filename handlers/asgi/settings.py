"""What the engine's launching process decides and hands to each server process: ``EngineSettings``,
put in the environment (``ENGINE_ENV``) for uvicorn's worker processes, and the check that the gRPC
port they share is free. The launcher (uvicorn's supervisor, where there are several processes)
imports this, not the application: it serves nothing and never loads torch.

    os.environ[ENGINE_ENV] = EngineSettings((Path("/tmp/x/tiny"),), Path("keys.json")).to_env()
    settings = EngineSettings.from_env()             # in each server process
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import orjson

from handlers.runtime.errors import InputError

ENGINE_ENV = "TORCHREC_SERVE_ASGI"


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """``folders``: the unpacked archives to serve; ``key_file``: the keys (``key_file.py``);
    ``store`` and ``state_dir``: the model store and the engine's state folder, for the
    management routes (``management.py``); each process serves the wanted state found there too.
    ``grpc_host``, ``grpc_port``: where the gRPC service listens (port 0: no gRPC)."""

    folders: tuple[Path, ...]
    key_file: Path
    store: Path | None = None
    state_dir: Path | None = None
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0

    def to_env(self) -> str:
        return orjson.dumps({
            "folders": [str(f) for f in self.folders], "key_file": str(self.key_file),
            "store": self.store and str(self.store), "state_dir": self.state_dir and str(self.state_dir),
            "grpc_host": self.grpc_host, "grpc_port": self.grpc_port,
        }).decode()

    @classmethod
    def from_env(cls) -> "EngineSettings":
        raw = orjson.loads(os.environ[ENGINE_ENV])
        optional = {k: Path(raw[k]) for k in ("store", "state_dir") if raw.get(k)}
        return cls(
            tuple(Path(f) for f in raw["folders"]), Path(raw["key_file"]), **optional,
            grpc_host=raw["grpc_host"], grpc_port=raw["grpc_port"],
        )


def check_port_free(host: str, port: int) -> None:
    """``InputError`` when something listens on ``host:port`` already (another server's gRPC
    processes would take half of the connections each, without an error)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections closed lately do not count
        try:
            probe.bind((host, port))
        except OSError as error:
            raise InputError(
                f"--grpc-port: {listen_address(host, port)} is in use ({error.strerror}); give another port, or 0 for no gRPC"
            ) from None


def listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
