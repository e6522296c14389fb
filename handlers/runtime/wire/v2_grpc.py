"""The Open Inference Protocol over gRPC (``open_inference.proto``, beside this module) in terms of
its REST form: a ``ModelInferRequest`` becomes the request ``kserve_v2`` decodes from
``POST /v2/models/NAME/infer``, and the runtime's v2 answer becomes a ``ModelInferResponse``. One
decoder, one scorer and one set of field messages serve both transports.

* Typed ``contents`` become JSON ``data`` (the body handed over parsed, as a dict), answered in
  each output's ``contents``;
* ``raw_input_contents`` become binary tensors after a JSON header, as the REST binary extension
  sends them, answered in ``raw_output_contents`` (as KServe's own server answers raw requests).

    arrival = infer_arrival(request)                # ModelInferRequest -> Arrival, to a batcher
    reply = infer_response(await batcher.submit(arrival))   # Response (status 200) -> ModelInferResponse

Problems only the gRPC form can have name its fields as the decoder names the rest, e.g.
``inputs[1] (sparse_features.lengths).contents: INT64 values go in int64_contents, got
fp32_contents`` (a ``BadRequest``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from google.protobuf.message import Message

from handlers.runtime.errors import BadRequest
from handlers.runtime.protos import PrivateMessages, private_messages
from handlers.runtime.wire.messages import Response
from handlers.runtime.wire.transport import Arrival
from handlers.runtime.wire.v2_headers import BINARY, HEADER_LENGTH

PROTO = Path(__file__).resolve().parent / "open_inference.proto"
SERVICE = "inference.GRPCInferenceService"

# The protocol's contents field of each datatype (FP16 and BF16 have none: they travel raw).
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def messages() -> PrivateMessages:
    """The protocol's message classes and service, compiled once per process."""
    return private_messages(PROTO)


def infer_arrival(request: Any) -> Arrival:
    """A ``ModelInferRequest`` as the REST route hands its body to the runtime."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(
            "raw_input_contents",
            f"{len(raw)} entries for {len(request.inputs)} inputs: give one per input, in their order",
        )
    tensors = []
    for i, tensor in enumerate(request.inputs):
        field = f"inputs[{i}] ({tensor.name})"
        given = [descriptor.name for descriptor, _ in tensor.contents.ListFields()]
        sent: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if raw:
            if given:
                raise BadRequest(
                    f"{field}.contents", "given with raw_input_contents: send each input's values in one of them"
                )
            sent["parameters"] = {"binary_data_size": len(raw[i])}
        else:
            sent["data"] = _values(field, tensor.datatype, tensor.contents, given)
        tensors.append(sent)
    body: dict[str, Any] = {"inputs": tensors}
    if request.id:
        body["id"] = request.id
    binary = bool(raw)  # answered as asked: raw for raw, typed contents for typed
    if request.outputs:
        body["outputs"] = [{"name": o.name, "parameters": {"binary_data": binary}} for o in request.outputs]
    else:
        body["parameters"] = {"binary_data_output": binary}
    if not binary:
        return Arrival(body)
    header = orjson.dumps(body)
    return Arrival(b"".join([header, *raw]), BINARY, None, str(len(header)))


def infer_response(response: Response) -> Message:
    """The runtime's v2 answer (status 200: its JSON header, then any binary outputs) as a
    ``ModelInferResponse``."""
    body = memoryview(response.body)
    length = int(response.headers.get(HEADER_LENGTH, len(body)))
    header = orjson.loads(body[:length])
    reply = messages().message("inference.ModelInferResponse")(
        model_name=header["model_name"], model_version=header.get("model_version", ""), id=header.get("id", "")
    )
    offset = length
    for tensor in header["outputs"]:
        output = reply.outputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        size = tensor.get("parameters", {}).get("binary_data_size")
        if size is None:
            getattr(output.contents, CONTENTS[tensor["datatype"]]).extend(tensor["data"])
        else:
            reply.raw_output_contents.append(bytes(body[offset : offset + size]))
            offset += size
    return reply


def error_message(response: Response) -> str:
    """A v2 error answer's message (``{"error": "<field>: <problem>"}``)."""
    return orjson.loads(response.body)["error"]


def _values(field: str, datatype: str, contents: Any, given: list[str]) -> list:
    """A typed tensor's values, from the contents field of its datatype (a datatype without one
    takes whichever is given, for the decoder to judge)."""
    wanted = CONTENTS.get(datatype)
    if len(given) > 1 or (wanted is not None and given and given != [wanted]):
        expected = f"{datatype} values go in {wanted}" if wanted else "give one contents field"
        raise BadRequest(f"{field}.contents", f"{expected}, got {', '.join(given)}")
    return list(getattr(contents, given[0])) if given else []
