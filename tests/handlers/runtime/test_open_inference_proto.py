"""handlers/runtime/wire/open_inference.proto against Triton's published ``grpc_service.proto``
(its client's compiled descriptors): every message the project declares is Triton's, field for
field (name, number, type, repetition, oneof), and every call it serves has Triton's name and
types, so that a standard client's bytes mean the same on both sides. Both live in one process:
the project's messages are in a descriptor pool of their own (``handlers.runtime.protos``).
"""

from __future__ import annotations

from tritonclient.grpc import service_pb2

from handlers.runtime.wire.v2_grpc import SERVICE, messages

TRITON = service_pb2.DESCRIPTOR


def _fields(message) -> dict[str, tuple]:
    return {
        f.name: (f.number, f.type, f.is_repeated, f.message_type and f.message_type.full_name,
                 f.containing_oneof and f.containing_oneof.name)
        for f in message.fields
    }


def _messages(message) -> list:
    """The message and those nested in it (map entries included)."""
    return [message, *[m for nested in message.nested_types for m in _messages(nested)]]


def test_every_message_is_triton_s_field_for_field():
    ours = messages().pool.FindFileByName("open_inference.proto")
    assert ours.package == TRITON.package == "inference"
    declared = [m for top in ours.message_types_by_name.values() for m in _messages(top)]
    assert len(declared) > 20  # ModelInferRequest's tensors, parameters' map entries, ...
    for message in declared:
        theirs = TRITON.pool.FindMessageTypeByName(message.full_name)
        assert _fields(message) == _fields(theirs), message.full_name


def test_every_call_is_triton_s():
    ours = messages().service(SERVICE)
    theirs = TRITON.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == "inference.GRPCInferenceService"
    served = {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"}
    assert {m.name for m in ours.methods} == served
    for method in ours.methods:
        reference = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            reference.input_type.full_name, reference.output_type.full_name)
        assert not method.client_streaming and not method.server_streaming


def test_a_message_written_by_triton_s_classes_reads_the_same():
    request = service_pb2.ModelInferRequest(model_name="tiny", model_version="1.0", id="r1")
    tensor = request.inputs.add(name="dense_features", datatype="FP32", shape=[2, 4])
    tensor.parameters["binary_data_size"].int64_param = 32
    tensor.contents.fp32_contents.extend([0.5] * 8)
    request.outputs.add(name="scores")
    request.raw_input_contents.append(b"\x00\x01")
    request.parameters["priority"].uint64_param = 3
    read = messages().message("inference.ModelInferRequest").FromString(request.SerializeToString())
    assert (read.model_name, read.model_version, read.id) == ("tiny", "1.0", "r1")
    (tensor,) = read.inputs
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("dense_features", "FP32", [2, 4])
    assert list(tensor.contents.fp32_contents) == [0.5] * 8
    assert tensor.parameters["binary_data_size"].int64_param == 32
    assert [o.name for o in read.outputs] == ["scores"] and list(read.raw_input_contents) == [b"\x00\x01"]
    assert read.parameters["priority"].uint64_param == 3
    assert read.SerializeToString(deterministic=True) == request.SerializeToString(deterministic=True)
