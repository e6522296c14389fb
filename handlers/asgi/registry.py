"""The models one ASGI process serves: each archive folder loaded once, as a TorchServe worker
loads it (``handlers.torchserve_handler.DLRMHandler.initialize``): the ``handler`` options, the
freshness section and the tables' working copy (``WorkerFreshness.open``), ``load_service``, the
delta log replayed behind a ``LockedRunner``; then a ``Batcher`` with the archive's batching and
admission settings.

    models = ModelRegistry.load([Path("/tmp/asgi-x/tiny")], forwards)   # before serving
    model = models.get("tiny", version=None)     # the first version loaded; ModelNotFoundException
    await model.batcher.submit(arrival)
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Callable, Sequence

import orjson

from handlers.asgi.admission import AdmissionRule
from handlers.asgi.batcher import Batcher, BatchPolicy
from handlers.asgi.connections import CONNECTIONS
from handlers.asgi.metrics import EngineMetrics, ModelMetrics
from handlers.loading import load_service
from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import MANIFEST
from handlers.runtime.batch_counts import batch_increments, raw_id_increments
from handlers.runtime.errors import InputError, ModelNotFoundException
from handlers.runtime.freshness.config import FreshnessConfig
from handlers.runtime.freshness.worker import LockedRunner, WorkerFreshness
from handlers.runtime.remote.lookups import ShardedLookups
from handlers.runtime.service import ScoringService
from handlers.runtime.wire.messages import Response
from handlers.runtime.wire.transport import Arrival

logger = logging.getLogger(__name__)


def freeze_loaded() -> None:
    """The objects of the models loaded so far out of the collector's walks (``gc.freeze``, as
    the TorchServe adapter does): left in its oldest generation, a full collection walked them
    every half second under load, 40-55 ms each, the p99 of one-item requests at c=32."""
    gc.collect()
    gc.freeze()


@dataclasses.dataclass
class ServedModel:
    name: str
    version: str | None
    service: ScoringService
    batcher: Batcher
    freshness: WorkerFreshness | str  # or why the archive takes no deltas
    folder: Path | None = None  # the unpacked archive it was loaded from
    read_raw_ids: Callable[[], None] | None = None  # a raw-id model's counts, into the metrics
    metrics_every_s: float = 1.0  # how often (the handler's metrics_flush_s)


class ModelRegistry:
    """Models by name, then version; a name's default is the version set by ``defaults``, else its
    first version loaded."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        self.models: list[ServedModel] = []
        self._by_name: dict[str, dict[str | None, ServedModel]] = {}
        self.defaults: dict[str, str | None] = {}  # name -> its default version, where one was set
        for model in models:
            self.add(model)

    def add(self, model: ServedModel) -> None:
        versions = self._by_name.setdefault(model.name, {})
        if model.version in versions:
            raise InputError(f"model {model.name} version {model.version}: given twice")
        versions[model.version] = model
        self.models.append(model)

    def remove(self, model: ServedModel) -> None:
        versions = self._by_name[model.name]
        del versions[model.version]
        if not versions:
            del self._by_name[model.name]
        self.models.remove(model)

    def names(self) -> list[str]:
        return list(self._by_name)

    def default_version(self, name: str) -> str | None:
        versions = self._by_name[name]
        wanted = self.defaults.get(name)
        return wanted if wanted in versions else next(iter(versions))

    @classmethod
    def load(cls, folders: Sequence[Path], forwards: Executor, metrics: EngineMetrics | None = None) -> "ModelRegistry":
        return cls([load_model(folder, forwards, metrics) for folder in folders])

    def get(self, name: str, version: str | None = None) -> ServedModel:
        versions = self._by_name.get(name)
        if versions is None:
            raise ModelNotFoundException(f"Model not found: {name}")
        if version is None:
            return versions[self.default_version(name)]
        if version not in versions:
            raise ModelNotFoundException(f"Model version: {version} does not exist for model: {name}")
        return versions[version]

    def versions(self, name: str) -> list[str]:
        self.get(name)
        return [v for v in self._by_name[name] if v is not None]


def load_model(folder: Path, forwards: Executor, metrics: EngineMetrics | None = None) -> ServedModel:
    """An unpacked archive's model, loaded as a TorchServe worker loads it, behind its batcher;
    its batches counted in ``metrics`` (None: not counted)."""
    started = time.perf_counter()
    archive = Archive(folder)
    config: dict[str, Any] = archive.model_config
    options = archive.options
    name, version = manifest_model(archive)
    freshness = WorkerFreshness.open(folder, options, FreshnessConfig.from_mapping(config.get("freshness")))
    tables = freshness.weights_file if isinstance(freshness, WorkerFreshness) else None
    service = load_service(folder, options, None, model_name=name, tables_file=tables, model_version=version)
    if isinstance(freshness, WorkerFreshness):
        freshness.start(service.model)  # the model's delta log replayed before the first request
        service.model = LockedRunner(service.model, freshness.lock)
    policy = BatchPolicy.from_model_config(config, str(folder))
    rule = AdmissionRule(
        label=f"model {name} version {version}",
        batch_size=policy.batch_size,
        max_queue_wait_ms=_guard_wait_ms(config, folder),
    )
    counted = metrics.model(name, version) if metrics is not None else None
    handle = functools.partial(_handle, service, counted)
    batcher = Batcher(
        handle, policy, forwards, rule, CONNECTIONS.all_waiting, counted.queued if counted else lambda waited_s: None
    )
    logger.info(
        "loaded model %s version %s from %s, running %s in %.2fs (batch %d, %g ms)",
        name, version, folder, options.describe(), time.perf_counter() - started, policy.batch_size, policy.max_delay_ms,
    )
    read_raw_ids = None
    if counted is not None and service.unseen_ids is not None:
        raw_ids = service.unseen_ids
        read_raw_ids = lambda: counted.add(raw_id_increments(raw_ids))  # noqa: E731
    return ServedModel(name, version, service, batcher, freshness, folder, read_raw_ids, options.metrics_flush_s)


def _handle(service: ScoringService, counted: ModelMetrics | None, arrivals: Sequence[Arrival]) -> list[Response]:
    """One batch scored (on the forward thread), and counted."""
    handled = service.handle(arrivals)
    if counted is not None:
        counted.add(batch_increments(len(arrivals), handled.stats))
        lookups = getattr(service.model, "sparse", None)  # a dense host's calls to its shards
        if isinstance(lookups, ShardedLookups):
            counted.add((name, labels, value) for (name, labels), value in lookups.take_counts().items())
    return handled.responses


def manifest_model(archive: Archive) -> tuple[str, str | None]:
    """The model's name and version, as torch-model-archiver's manifest gives them to TorchServe."""
    try:
        model = orjson.loads(archive.file(MANIFEST).read_bytes())["model"]
        return str(model["modelName"]), (str(model["modelVersion"]) if model.get("modelVersion") else None)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise InputError(f"{archive.path}: {MANIFEST}: must name model.modelName") from None


def _guard_wait_ms(config: dict[str, Any], folder: Path) -> int:
    guard = config.get("guard") or {}
    wait = guard.get("max_queue_wait_ms", 0) if isinstance(guard, dict) else 0
    if type(wait) is not int or wait < 0:
        raise InputError(f"{folder}: guard.max_queue_wait_ms: must be a whole number >= 0, got {wait!r}")
    return wait
