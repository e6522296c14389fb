"""Shared fixtures: the tiny DLRM and the context ranker, seeded float models and their weights."""

from __future__ import annotations

import gc

# Collection imports torch, TorchRec and every test module: with the collector paused, the full
# collections their new objects trigger do not walk torch's again and again (a process's
# collection: 9.7 CPU-seconds, 6.6 paused). Resumed once collected (pytest_collection_finish), or
# at the session's start in xdist's controller, which collects nothing.
gc.disable()

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from archive_tools.compile_cache import CACHE_ENV
from archive_tools.local_server import VMARGS_ENV
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.modeling.spec import ModelSpec
from handlers.modeling.weights import InferenceWeights

# The suite's servers live seconds, their JIT's C2 tier never pays back: C1 alone spends a third
# less of the frontend's CPU (benchmark smokes run in child processes, which inherit it).
os.environ.setdefault(VMARGS_ENV, "-XX:TieredStopAtLevel=1")

# An AOTInductor package one test compiles, another reuses (the same graph with other weights:
# archive_tools.compile_cache), from a folder of this run's own that pytest's processes share
# (they inherit it): each run compiles what it needs once, from nothing, as on a fresh machine.
_OWN_COMPILE_CACHE = CACHE_ENV not in os.environ
if _OWN_COMPILE_CACHE:
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="torchrec-serve-compile-cache-")

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "config" / "models"
TINY_SPEC = MODELS / "tiny.yaml"
CRITEO_SPEC = MODELS / "criteo.yaml"
RANKER_SPEC = MODELS / "ranker.yaml"

# ``make test`` runs the files in two processes (pytest -n 2 --dist loadfile), each taking the next
# file as it finishes one: the slowest go first (every file of 5 s and more), so that both finish at
# about the same time, with the files of unit tests (a second or two each) last to even out the end;
# and those that compile AOTInductor packages before the benchmark smoke runs, whose loads are paced
# by the capacity they measured at their start.
SLOWEST_FIRST = (
    "tests/archive_tools/test_export.py",
    "tests/integration/test_user_models.py",
    "tests/archive_tools/test_dense_delta.py",
    "tests/handlers/modeling/test_dlrm_dcn.py",
    "tests/integration/test_raw_ids.py",
    "tests/bench/test_reliability.py",
    "tests/integration/test_publishing.py",
    "tests/integration/test_table_copies.py",
    "tests/bench/test_smoke.py",
    "tests/bench/test_engines.py",
    "tests/integration/test_distributed.py",
    "tests/bench/test_freshness.py",
    "tests/bench/test_raw_ids_scenario.py",
    "tests/integration/test_asgi_management.py",
    "tests/integration/test_serving.py",
    "tests/integration/test_plugin.py",
    "tests/integration/test_torchserve.py",
    "tests/integration/test_protocols.py",
    "tests/archive_tools/test_planning.py",
    "tests/integration/test_tensor_client.py",
    "tests/integration/test_local_server.py",
    "tests/test_torch_contracts.py",
    "tests/integration/test_asgi_metrics.py",
    "tests/test_packaging.py",
    "tests/bench/test_load.py",
    "tests/archive_tools/test_cli.py",
    "tests/integration/test_context_ranker.py",
    "tests/integration/test_idle_metrics.py",
    "tests/integration/test_asgi_engine.py",
    "tests/integration/test_open_inference.py",
    "tests/handlers/runtime/test_shared_tables.py",
    "tests/integration/test_asgi_grpc.py",
    "tests/handlers/runtime/test_split.py",
)


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.pluginmanager.has_plugin("dsession"):  # xdist's controller
        gc.enable()


def pytest_collection_finish(session: pytest.Session) -> None:
    # What the test modules imported (torch, TorchRec: half a million objects) lives as long as
    # the process: frozen, it is left out of every full collection the tests' garbage triggers
    # (each walk 0.2 s) and of the interpreter's last ones at exit.
    gc.freeze()
    gc.enable()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_COMPILE_CACHE:
        shutil.rmtree(os.environ[CACHE_ENV], ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as found


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    return load_spec(TINY_SPEC)


@pytest.fixture(scope="session")
def tiny_float_model(tiny_spec):
    return DLRMFactory(tiny_spec).float_model(seed=0)


@pytest.fixture(scope="session")
def tiny_weights(tiny_spec, tiny_float_model) -> InferenceWeights:
    return DLRMFactory(tiny_spec).quantize(tiny_float_model)


@pytest.fixture(scope="session")
def ranker_spec() -> ModelSpec:
    return load_spec(RANKER_SPEC)


@pytest.fixture(scope="session")
def ranker_float_model(ranker_spec):
    return DLRMFactory(ranker_spec).float_model(seed=0)


@pytest.fixture(scope="session")
def ranker_weights(ranker_spec, ranker_float_model) -> InferenceWeights:
    return DLRMFactory(ranker_spec).quantize(ranker_float_model)
