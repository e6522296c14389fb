"""Protocol buffers the package carries as ``.proto`` files, compiled when first used by
grpcio-tools' protoc (no generated code in the repository), once per process and file:

* ``python_modules``: the ``_pb2`` and ``_pb2_grpc`` modules, messages in protobuf's default pool
  (TorchServe's API, ``remote.grpc_stubs``);
* ``private_messages``: the message classes in a descriptor pool of their own, so that the process
  may also hold another program's messages of the same full names (Triton's client declares
  package ``inference`` too, as the Open Inference Protocol does).

    pb2, pb2_grpc = python_modules(Path("torchserve_inference.proto"))
    proto = private_messages(Path("open_inference.proto"))
    request = proto.message("inference.ModelInferRequest")(model_name="tiny")
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message


@dataclasses.dataclass(frozen=True)
class PrivateMessages:
    """A ``.proto``'s messages and services, in their own descriptor pool."""

    pool: descriptor_pool.DescriptorPool

    def message(self, full_name: str) -> type[Message]:
        return message_factory.GetMessageClass(self.pool.FindMessageTypeByName(full_name))

    def service(self, full_name: str) -> ServiceDescriptor:
        return self.pool.FindServiceByName(full_name)


@functools.cache
def python_modules(proto: Path) -> tuple[ModuleType, ModuleType]:
    """``proto``'s ``<stem>_pb2`` and ``<stem>_pb2_grpc`` modules, imported (the files they were
    written to are gone; the modules live on without them)."""
    out = Path(tempfile.mkdtemp(prefix="torchrec-serve-proto-"))
    try:
        _protoc(proto, f"--python_out={out}", f"--grpc_python_out={out}")
        sys.path.insert(0, str(out))
        try:
            return importlib.import_module(f"{proto.stem}_pb2"), importlib.import_module(f"{proto.stem}_pb2_grpc")
        finally:
            sys.path.remove(str(out))
    finally:
        shutil.rmtree(out, ignore_errors=True)


@functools.cache
def private_messages(proto: Path) -> PrivateMessages:
    """``proto`` compiled to descriptors (with those it imports), added to a new pool."""
    out = Path(tempfile.mkdtemp(prefix="torchrec-serve-proto-"))
    try:
        descriptors = out / f"{proto.stem}.pb"
        _protoc(proto, f"--descriptor_set_out={descriptors}", "--include_imports")
        files = descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    return PrivateMessages(pool)


def _protoc(proto: Path, *outputs: str) -> None:
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"  # protobuf's own (google/protobuf/*.proto)
    status = protoc.main(["grpc_tools.protoc", f"-I{proto.parent}", f"-I{include}", *outputs, str(proto)])
    if status != 0:
        raise RuntimeError(f"grpcio-tools could not compile {proto} (exit {status})")
