"""TorchServe's gRPC inference API, for the project's client and for a dense host calling its
embedding shards: the stubs, compiled by grpcio-tools from ``torchserve_inference.proto`` (beside
this module, so every archive carries it) once per process (``handlers.runtime.protos``).

    stub = inference_stub(channel)
    answer = stub.Predictions(PredictionsRequest(model_name="criteo", input={"body": body}))
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from handlers.runtime.protos import python_modules

PROTO = Path(__file__).resolve().parent / "torchserve_inference.proto"


def messages() -> ModuleType:
    """The compiled message classes (``PredictionsRequest``, ``PredictionResponse``)."""
    return python_modules(PROTO)[0]


def inference_stub(channel: Any) -> Any:
    """A stub of ``InferenceAPIsService`` on ``channel``."""
    return python_modules(PROTO)[1].InferenceAPIsServiceStub(channel)
