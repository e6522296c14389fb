"""Helpers shared by the tests: spec variants, requests, and model inputs built from them; the
ASGI engine as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
import torch

from archive_tools.local_server import free_port
from handlers.loading import load_archive
from handlers.runtime.archive import Archive
from handlers.modeling.eager import EagerModel
from handlers.modeling.registry import input_schema, synthetic_request
from handlers.modeling.spec import ModelSpec, ShardingSpec, ShardingType
from handlers.runtime.batching import Batch, coalesce
from handlers.runtime.freshness.applier import file_offset
from handlers.runtime.inputs import OutOfRangePolicy
from handlers.runtime.service import ScoringService
from handlers.runtime.wire.decoder import RequestDecoder
from torchrec import KeyedJaggedTensor  # isort: skip

items_request = synthetic_request  # (spec, num_items, seed, max_bag=3, return_logits=False)

# How far served scores may lie from the float model's: the build's own bound (Bounds), which
# per-table int8/int4/fp16 quantization keeps within.
QUANTIZATION_TOLERANCE = 0.02


def float_scores(model: torch.nn.Module, spec: ModelSpec, request: dict) -> torch.Tensor:
    """The float TorchRec model's click probabilities for one JSON request of items, its inputs
    made here from the request with TorchRec's own ``KeyedJaggedTensor`` rather than by the
    serving decoder and coalescer: the independent reference that served scores are held to."""
    items = request["items"]
    schema = input_schema(spec)
    values: list[int] = []
    weights: list[float] = []
    lengths: list[int] = []
    for feature in schema.features:
        for item in items:
            bag = item.get("sparse", {}).get(feature.name, [])
            ids, bag_weights = (bag["ids"], bag["weights"]) if isinstance(bag, dict) else (bag, [1.0] * len(bag))
            if schema.out_of_range == OutOfRangePolicy.HASH:
                ids = [i % feature.rows for i in ids]
            values += ids
            weights += bag_weights
            lengths.append(len(ids))
    ids = KeyedJaggedTensor(
        keys=list(schema.feature_names),
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
        weights=torch.tensor(weights, dtype=torch.float32) if schema.weighted_ids else None,
    )
    dense = torch.tensor([item["dense"] for item in items], dtype=torch.float32)
    with torch.inference_mode():
        if "context" in request:
            context = torch.tensor([request["context"]], dtype=torch.float32)
            logits = model(dense, ids, context, torch.tensor([len(items)]))
        else:
            logits = model(dense, ids)
    return torch.sigmoid(logits.reshape(-1))


def with_tables(spec: ModelSpec, **changes) -> ModelSpec:
    """The spec with ``changes`` (e.g. weight_dtype=..., sharding=...) applied to every table."""
    return spec.replace(tables=[t.model_copy(update=changes) for t in spec.tables])


# tiny's tables pruned: two summed ones and the mean-pooled one (rows kept of their rows)
PRUNED_TINY = {"t_user": 300, "t_item": 200, "t_category": 20}


def pruned(spec: ModelSpec, folder: Path, seed: int = 0) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """``spec`` with ``PRUNED_TINY``'s tables pruned to random kept ids (written to
    ``folder/pruning.pt``), and those ids."""
    generator = torch.Generator().manual_seed(seed)
    rows = {t.name: t.rows for t in spec.tables}
    kept = {n: torch.randperm(rows[n], generator=generator)[:k].sort().values for n, k in PRUNED_TINY.items()}
    torch.save(kept, folder / "pruning.pt")
    tables = [t.model_copy(update={"pruned_to": PRUNED_TINY.get(t.name)}) for t in spec.tables]
    return spec.replace(tables=tables, pruning=str(folder / "pruning.pt")), kept


def sharded(spec: ModelSpec, world_size: int, sharding: ShardingType) -> ModelSpec:
    return with_tables(spec, sharding=sharding).replace(
        sharding=ShardingSpec(device="cpu", world_size=world_size)
    )


def model_inputs(spec: ModelSpec, requests: list[dict]) -> Batch:
    """Decodes JSON-like requests and coalesces them into one batch of model inputs."""
    schema = input_schema(spec)
    decoder = RequestDecoder(schema)
    return coalesce([decoder.decode(r).inputs for r in requests], schema.tags)


def forward(model: torch.nn.Module, spec: ModelSpec, inputs: Batch) -> torch.Tensor:
    """An eager model's logits for a batch of ``spec``'s inputs, flattened."""
    with torch.inference_mode():
        return EagerModel(model, input_schema(spec).tags)(inputs).reshape(-1)


def is_file_mapped(tensor: torch.Tensor, path) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of the file ``path`` (``/proc/self/maps``)."""
    try:
        file_offset(tensor, Path(path))
    except ValueError:
        return False
    return True


_OPEN: list[Archive] = []  # a .mar's unpacked files stay for the session: its services run on them


def archive_service(archive: Path) -> ScoringService:
    """A built archive (``.mar`` or folder) loaded in this process as a worker loads it."""
    _OPEN.append(Archive.open(archive))
    return load_archive(_OPEN[-1])


def run_scenario(scenario: str, out: Path, timeout_s: float = 900) -> None:
    """``python -m benchmarks SCENARIO --out OUT`` from the checkout, as ``make bench`` runs it;
    fails the test with the end of its stderr if it fails."""
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", scenario, "--out", str(out)],
        cwd=repo, capture_output=True, text=True, timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-3000:]


class AsgiServer:
    """``torchrec-serve serve --engine asgi`` in its own process group, stopped by pid: HTTP on
    ``url``, gRPC on ``grpc_target`` (free ports: a shared gRPC port would split a server's calls
    with another's)."""

    def __init__(self, store: Path, archives: list[str], workers: int, workdir: Path) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        self.key_file = workdir / "keys.json"
        self.log = workdir / "server.out"
        command = [sys.executable, "-m", "archive_tools", "serve", "--engine", "asgi", *archives,
                   "--model-store", str(store), "--port", str(self.port), "--grpc-port", str(self.grpc_port),
                   "--workers", str(workers), "--key-file", str(self.key_file)]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(timeout_s=180)
        except BaseException:
            self.stop()
            raise
        self.key = json.loads(self.key_file.read_text())["inference"]["key"]
        self.auth = {"Authorization": f"Bearer {self.key}"}

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited:\n{self.log.read_text()[-3000:]}")
            try:
                if requests.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"not ready in {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def post(self, path: str, body: bytes | str | dict, headers: dict | None = None, auth: bool = True) -> requests.Response:
        data = json.dumps(body) if isinstance(body, dict) else body
        sent = {"Content-Type": "application/json", **(self.auth if auth else {}), **(headers or {})}
        return requests.post(f"{self.url}{path}", data=data, headers=sent, timeout=60)

    def stats(self, model: str) -> dict[int, int]:
        """{requests in a batch: batches}, this process's (the statistics route)."""
        stats = requests.get(f"{self.url}/v2/models/{model}/stats", headers=self.auth, timeout=10).json()
        return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["model_stats"][0]["batch_stats"]}

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # start_new_session: the group is the server's pid
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
