"""Shared fixtures: the tiny DLRM and the context ranker, seeded float models and their weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from handlers.factory import DLRMFactory, InferenceWeights
from handlers.spec import ModelSpec

REPO = Path(__file__).resolve().parent.parent
TINY_SPEC = REPO / "config" / "models" / "tiny.yaml"
CRITEO_SPEC = REPO / "config" / "models" / "criteo.yaml"
RANKER_SPEC = REPO / "config" / "models" / "ranker.yaml"


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    return ModelSpec.from_yaml(TINY_SPEC)


@pytest.fixture(scope="session")
def tiny_float_model(tiny_spec):
    return DLRMFactory(tiny_spec).float_model(seed=0)


@pytest.fixture(scope="session")
def tiny_weights(tiny_spec, tiny_float_model) -> InferenceWeights:
    return DLRMFactory(tiny_spec).quantize(tiny_float_model)


@pytest.fixture(scope="session")
def ranker_spec() -> ModelSpec:
    return ModelSpec.from_yaml(RANKER_SPEC)


@pytest.fixture(scope="session")
def ranker_float_model(ranker_spec):
    return DLRMFactory(ranker_spec).float_model(seed=0)


@pytest.fixture(scope="session")
def ranker_weights(ranker_spec, ranker_float_model) -> InferenceWeights:
    return DLRMFactory(ranker_spec).quantize(ranker_float_model)
