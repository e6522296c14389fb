"""TorchServe's gRPC inference API, for the project's client and for a dense host calling its
embedding shards: the stubs, compiled by grpcio-tools from ``torchserve_inference.proto`` (beside
this module, so every archive carries it) once per process.

    stub = inference_stub(channel)
    answer = stub.Predictions(PredictionsRequest(model_name="criteo", input={"body": body}))
"""

from __future__ import annotations

import functools
import importlib
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

PROTO = Path(__file__).resolve().parent / "torchserve_inference.proto"


@functools.cache
def messages() -> ModuleType:
    """The compiled message classes (``PredictionsRequest``, ``PredictionResponse``)."""
    return _compiled()[0]


def inference_stub(channel: Any) -> Any:
    """A stub of ``InferenceAPIsService`` on ``channel``."""
    return _compiled()[1].InferenceAPIsServiceStub(channel)


@functools.cache
def _compiled() -> tuple[ModuleType, ModuleType]:
    from grpc_tools import protoc

    out = Path(tempfile.mkdtemp(prefix="torchserve-grpc-"))
    include = Path(protoc.__file__).parent / "_proto"
    status = protoc.main([
        "grpc_tools.protoc", f"-I{PROTO.parent}", f"-I{include}",
        f"--python_out={out}", f"--grpc_python_out={out}", str(PROTO),
    ])
    if status != 0:
        raise RuntimeError(f"grpcio-tools could not compile {PROTO} (exit {status})")
    sys.path.insert(0, str(out))
    try:
        return (
            importlib.import_module(f"{PROTO.stem}_pb2"),
            importlib.import_module(f"{PROTO.stem}_pb2_grpc"),
        )
    finally:
        sys.path.remove(str(out))
        shutil.rmtree(out, ignore_errors=True)  # imported: the modules live on without their files
