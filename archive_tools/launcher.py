"""A distributed layout on this machine, from one layout file: one TorchServe per host (each with
its own loopback ports and working directory, health-checked, stopped by pid), the shard
archives registered on their hosts, then the dense hosts, told where the shards are by a
placement file (``handlers.runtime.remote.plan``).

    torchrec-serve launch examples/layouts/tiny_distributed.yaml     # until Ctrl-C

    with LocalLayout(LayoutFile.read(path)) as layout:
        layout.dense[0].predict("tinyd-dense", body)
        layout.shards["a"][0].stop()        # a shard host goes down; .start() brings it back

The layout file::

    model_store: model_store          # relative to the layout file
    dense: {archive: tinyd-dense, hosts: 1}
    shards:
      a: {archive: tinyd-a, hosts: 2}  # two replicas
      b: {archive: tinyd-b}

On real hosts the same archives are registered the same way, one TorchServe per host, and the
placement file lists each shard's replicas by address (see the README).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import yaml

from archive_tools.local_server import LocalTorchServe
from handlers.runtime.errors import InputError
from handlers.runtime.remote.plan import PLACEMENT_ENV

# Shard hosts answer their dense hosts only: inside a layout, on loopback here (on a private
# network between real hosts), without TorchServe's token (a dense host's calls carry none).
SHARD_SETTINGS = {"disable_token_authorization": "true"}


@dataclasses.dataclass(frozen=True)
class HostGroup:
    """``hosts`` TorchServe hosts, each serving the archive ``archive`` (its name in the store)."""

    archive: str
    hosts: int = 1

    @classmethod
    def parse(cls, raw: Any, field: str) -> "HostGroup":
        if not isinstance(raw, dict) or not isinstance(raw.get("archive"), str):
            raise InputError(f"{field}: must be {{archive: NAME, hosts: N}}, got {raw!r}")
        unknown = sorted(set(raw) - {"archive", "hosts"})
        if unknown:
            raise InputError(f"{field}.{unknown[0]}: unknown key")
        hosts = raw.get("hosts", 1)
        if type(hosts) is not int or hosts < 1:
            raise InputError(f"{field}.hosts: must be a whole number >= 1, got {hosts!r}")
        return cls(raw["archive"], hosts)

    def in_store(self, store: Path) -> str:
        """The name to register: the archive folder (``--archive-format no-archive``) or .mar."""
        if self.archive.endswith(".mar") or (store / self.archive).is_dir():
            return self.archive
        return f"{self.archive}.mar"

    @property
    def model(self) -> str:
        return self.archive.removesuffix(".mar")


@dataclasses.dataclass(frozen=True)
class LayoutFile:
    model_store: Path
    dense: HostGroup
    shards: dict[str, HostGroup]

    @classmethod
    def read(cls, path: str | Path) -> "LayoutFile":
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise InputError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise InputError(f"{path}: must be a mapping with model_store, dense and shards")
        unknown = sorted(set(raw) - {"model_store", "dense", "shards"})
        if unknown:
            raise InputError(f"{path}: {unknown[0]}: unknown key")
        shards = raw.get("shards")
        if not isinstance(shards, dict) or not shards:
            raise InputError(f"{path}: shards: must map each shard's name to {{archive, hosts}}")
        store = path.parent / str(raw.get("model_store", "model_store"))
        return cls(
            model_store=store.resolve(),
            dense=HostGroup.parse(raw.get("dense"), "dense"),
            shards={str(name): HostGroup.parse(group, f"shards.{name}") for name, group in shards.items()},
        )


class LocalLayout:
    """Starts every host of ``layout`` (shards first), and stops them all (dense hosts first)."""

    def __init__(self, layout: LayoutFile, keep_logs: Path | None = None) -> None:
        self.layout = layout
        self.keep_logs = keep_logs
        self.workdir = Path(tempfile.mkdtemp(prefix="layout-"))
        self.placement_file = self.workdir / "placement.yaml"
        self.shards: dict[str, list[LocalTorchServe]] = {}
        self.dense: list[LocalTorchServe] = []

    def __enter__(self) -> "LocalLayout":
        try:
            self.start()
        except BaseException:  # no host left behind when one fails to start
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        store = self.layout.model_store
        for shard, group in self.layout.shards.items():
            self.shards[shard] = []
            for i in range(group.hosts):
                server = LocalTorchServe(store, settings=SHARD_SETTINGS, keep_logs=self._logs(f"{shard}-{i}"))
                self.shards[shard].append(server)
                server.start()
                self._register(server, group)
        placement = {
            shard: [f"127.0.0.1:{s.ports['grpc_inference_port']}" for s in servers]
            for shard, servers in self.shards.items()
        }
        self.placement_file.write_text(yaml.safe_dump({"shards": placement}, sort_keys=False))
        for i in range(self.layout.dense.hosts):
            server = LocalTorchServe(
                store, env={PLACEMENT_ENV: str(self.placement_file)}, keep_logs=self._logs(f"dense-{i}")
            )
            self.dense.append(server)
            server.start()
            self._register(server, self.layout.dense)

    def stop(self) -> None:
        for server in self.dense + [s for servers in self.shards.values() for s in servers]:
            server.stop()
        self.placement_file.unlink(missing_ok=True)
        if self.workdir.exists():
            self.workdir.rmdir()

    def revive(self, shard: str, index: int) -> None:
        """Starts a stopped shard host again, on its ports, serving its shard."""
        server = self.shards[shard][index]
        server.start()
        self._register(server, self.layout.shards[shard])

    def publish(self, sequence: int) -> None:
        """Publishes the layout's delta ``sequence`` (``delta`` on the dense archive wrote one per
        shard) on every host of each shard."""
        for shard, servers in self.shards.items():
            model = self.layout.shards[shard].model
            for server in servers:
                response = server.management("POST", f"/freshness/{model}", params={"delta": f"{model}-{sequence:08d}.delta"})
                if response.status_code != 200:
                    raise InputError(f"publishing to shard {shard} at {server.management_url}: {response.status_code} {response.text}")

    def freshness(self) -> dict[str, dict]:
        """Every shard host's freshness state (its watermark: ``applied_sequence``), by host."""
        states = {}
        for shard, servers in self.shards.items():
            model = self.layout.shards[shard].model
            for i, server in enumerate(servers):
                states[f"{shard}-{i}"] = server.management("GET", f"/freshness/{model}").json()
        return states

    def describe(self) -> list[str]:
        """One line per host: what it serves and where."""
        lines = [
            f"shard {shard} host {i}: gRPC 127.0.0.1:{s.ports['grpc_inference_port']}, "
            f"management {s.management_url} ({self.layout.shards[shard].model})"
            for shard, servers in self.shards.items()
            for i, s in enumerate(servers)
        ]
        lines += [
            f"dense host {i}: inference {s.inference_url}, management {s.management_url} "
            f"({self.layout.dense.model}; keys in {s.workdir / 'key_file.json'})"
            for i, s in enumerate(self.dense)
        ]
        return lines + [f"placement: {self.placement_file}"]

    def _logs(self, host: str) -> Path | None:
        return self.keep_logs / host if self.keep_logs is not None else None

    def _register(self, server: LocalTorchServe, group: HostGroup) -> None:
        archive = group.in_store(self.layout.model_store)
        response = server.register(archive)
        if response.status_code != 200:
            raise InputError(f"registering {archive}: {response.status_code} {response.text}")
