"""Shared fixtures: the tiny DLRM and the context ranker, seeded float models and their weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.modeling.spec import ModelSpec
from handlers.modeling.weights import InferenceWeights

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "config" / "models"
TINY_SPEC = MODELS / "tiny.yaml"
CRITEO_SPEC = MODELS / "criteo.yaml"
RANKER_SPEC = MODELS / "ranker.yaml"


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
