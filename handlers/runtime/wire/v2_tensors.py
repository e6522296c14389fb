"""The sending side of the KServe v2 binary tensor format: a request of named numpy tensors as a
JSON header plus their bytes, and an answer back into numpy tensors. The project's client, its
benchmarks and (across hosts) its own workers write requests with it; ``kserve_v2`` reads them.

    body, json_length = encode_request({"dense_features": dense, ...}, outputs=("scores",))
    # POST body with header Inference-Header-Content-Length: json_length
    outputs = decode_response(answer_body, answer_json_length)   # {"scores": float32 [n]}
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

import numpy as np
import orjson

# numpy dtype -> v2 datatype, for what the models take and answer
DATATYPES = {
    np.dtype("float16"): "FP16",
    np.dtype("float32"): "FP32",
    np.dtype("float64"): "FP64",
    np.dtype("int8"): "INT8",
    np.dtype("int16"): "INT16",
    np.dtype("int32"): "INT32",
    np.dtype("int64"): "INT64",
    np.dtype("uint8"): "UINT8",
}
_NUMPY = {datatype: dtype for dtype, datatype in DATATYPES.items()}


class V2Error(RuntimeError):
    """The server answered with a v2 error (``{"error": ...}``)."""


def encode_request(
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] = ("scores",),
    binary_outputs: bool = True,
    request_id: str | None = None,
) -> tuple[bytes, int]:
    """(body, its JSON header's length): every input as binary data after the header."""
    tensors, blobs = [], []
    for name, array in inputs.items():
        array = np.ascontiguousarray(array)
        blob = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        tensors.append({
            "name": name,
            "datatype": DATATYPES[array.dtype],
            "shape": list(array.shape),
            "parameters": {"binary_data_size": len(blob)},
        })
        blobs.append(blob)
    header: dict = {"inputs": tensors}
    if request_id is not None:
        header["id"] = request_id
    header["outputs"] = [
        {"name": name, "parameters": {"binary_data": binary_outputs}} for name in outputs
    ]
    head = orjson.dumps(header)
    return head + b"".join(blobs), len(head)


def decode_response(body: bytes, json_length: int | None = None) -> dict[str, np.ndarray]:
    """The answer's outputs by name; ``json_length``: its ``Inference-Header-Content-Length``
    where a header carried it (None over gRPC: the JSON header then ends where its top-level
    object closes). Raises ``V2Error`` for an error answer."""
    view = memoryview(body)
    if json_length is None:
        json_length = _json_end(body)
    header = orjson.loads(view[:json_length])
    if "error" in header:
        raise V2Error(header["error"])
    offset = json_length
    outputs = {}
    for tensor in header["outputs"]:
        dtype = _NUMPY[tensor["datatype"]].newbyteorder("<")
        size = tensor.get("parameters", {}).get("binary_data_size")
        if size is None:
            outputs[tensor["name"]] = np.asarray(tensor["data"], dtype=dtype).reshape(tensor["shape"])
        else:
            data = np.frombuffer(view[offset : offset + size], dtype=dtype)
            outputs[tensor["name"]] = data.reshape(tensor["shape"])
            offset += size
    return outputs


def _json_end(body: bytes) -> int:
    """Where the JSON object at the start of ``body`` ends. Latin-1 maps each byte to one
    character, and the bytes of a UTF-8 character are never quotes or braces, so the decoder's
    end index is the byte offset."""
    _, end = json.JSONDecoder().raw_decode(body.decode("latin-1"))
    return end
