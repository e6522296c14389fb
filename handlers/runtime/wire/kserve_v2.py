"""The KServe v2 / Open Inference Protocol request, as KServe's and Triton's clients send it to
``POST /v2/models/{name}/infer`` (TorchServe routes it to the handler unchanged), in JSON or with
the binary tensor extension.

The model's inputs are named tensors, laid out as the batch tags lay them out (``F`` features,
``n`` items)::

    {"id": "r1",                                     # optional, echoed back
     "inputs": [
       {"name": "dense_features", "datatype": "FP32", "shape": [n, D], "data": [...]},
       {"name": "sparse_features.lengths", "datatype": "INT64", "shape": [F, n], "data": [...]},
       {"name": "sparse_features.values", "datatype": "INT64", "shape": [V], "data": [...]},
       {"name": "sparse_features.weights", "datatype": "FP32", "shape": [V], "data": [...]},
       {"name": "context_features", "datatype": "FP32", "shape": [1, C], "data": [...]},
       {"name": "<ids>.lengths", "datatype": "INT64", "shape": [F', 1], "data": [...]},
       {"name": "<ids>.values", "datatype": "INT64", "shape": [V'], "data": [...]}],
     "outputs": [{"name": "scores"}, {"name": "logits"}]}   # optional; default: scores

``weights`` only for a model with weighted ids (optional: 1), ``context_features`` only for a model
with a context input, ``<ids>.lengths`` and ``.values`` (``<ids>``: the input's name, e.g.
``history``) only for one that takes ids once per request, its F' features' sequences. JSON
``data`` is row-major, flat or nested. An embedding shard of a
distributed layout takes only the ids and answers ``embeddings``, FP32 [n, W]: each item's pooled
embeddings, feature after feature. With ``sparse_features.bags`` (INT64 [F]: feature f's bags are
its first bags_f items; the items after them must be empty) it answers only those, FP32
[sum of bags_f x D_f]: feature after feature, each a row-major [bags_f, D_f] block. A dense host
sends each distinct bag once this way (``handlers.runtime.remote.lookups``).

**Binary tensors** (the v2 binary extension, what Triton's clients send by default): the body is
the JSON header followed by the tensors' bytes, little-endian, row-major; the header's length
comes in the ``Inference-Header-Content-Length`` HTTP header, and a binary tensor has
``"parameters": {"binary_data_size": <bytes>}`` instead of ``data``. The tensors' bytes are read
where they lie in the body, not copied. An output asked for with ``"parameters": {"binary_data":
true}`` (or every output, with the request's ``"parameters": {"binary_data_output": true}``)
comes back the same way.

The answer::

    {"model_name": "criteo", "model_version": "1.0", "id": "r1",
     "outputs": [{"name": "scores", "datatype": "FP32", "shape": [n], "data": [...]}]}

(``model_version`` where the server knows it; the same JSON reaches a gRPC client of the Open
Inference Protocol's ``ModelInfer`` as TorchServe's ``ModelInferResponse``.)

and an error is ``{"error": "<field>: <problem>"}`` with its 4xx status.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
import torch

from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import InputSchema, JaggedIds, Output, RequestInputs
from handlers.runtime.validation import RequestChecks, bag_position
from handlers.runtime.wire.json_values import finite_float32s, int_array, json_type, reject_unknown
from handlers.runtime.wire.messages import DecodedRequest, DecodedRows, as_tensor
from handlers.runtime.wire.v2_answers import EMBEDDINGS, V2Encoder
from handlers.runtime.wire.v2_headers import HEADER_LENGTH

# v2 datatypes this model's inputs may come in, as little-endian numpy dtypes
FLOAT_TYPES = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}
INT_TYPES = {
    "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
}
OUTPUTS = ("scores", "logits")
# model_name: TorchServe's gRPC ModelInfer (Open Inference Protocol) copies it into the body
_REQUEST_KEYS = frozenset({"id", "model_name", "parameters", "inputs", "outputs"})
_TENSOR_KEYS = frozenset({"name", "shape", "datatype", "parameters", "data"})
_OUTPUT_KEYS = frozenset({"name", "parameters"})


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One named input as sent: its field path for errors, and JSON ``data`` or its ``raw`` bytes."""

    field: str
    datatype: Any
    shape: Any
    data: Any
    raw: memoryview | None


class V2Decoder:
    """A parsed v2 request (its JSON header, and the bytes after it for binary tensors) -> the
    request's inputs, answered by a ``V2Encoder``."""

    def __init__(
        self, schema: InputSchema, checks: RequestChecks, model_name: str, model_version: str | None = None
    ) -> None:
        self.schema = schema
        self.checks = checks
        self.model_name = model_name
        self.model_version = model_version
        jagged = schema.jagged.name
        self.embeddings = schema.output == Output.EMBEDDINGS
        self.default_output = EMBEDDINGS if self.embeddings else "scores"
        self.names = {
            "dense": None if self.embeddings else schema.rows.name,
            "lengths": f"{jagged}.lengths",
            "values": f"{jagged}.values",
            "weights": f"{jagged}.weights",
            "context": schema.context.name if schema.context else None,
            "context_lengths": f"{schema.context_jagged.name}.lengths" if schema.context_jagged else None,
            "context_values": f"{schema.context_jagged.name}.values" if schema.context_jagged else None,
            "bags": f"{jagged}.bags" if self.embeddings else None,
        }
        known = {n for key, n in self.names.items() if n and (key != "weights" or schema.weighted_ids)}
        self.known = frozenset(known)

    def encoder(self, body: dict) -> V2Encoder:
        """How to answer ``body``, as far as it can be read (errors need no more than this)."""
        request_id = body.get("id")
        return V2Encoder(
            self.model_name, request_id if isinstance(request_id, str) else None, (self.default_output,),
            model_version=self.model_version,
        )

    def decode(self, body: dict, binary: memoryview | None = None) -> DecodedRequest:
        reject_unknown(body, _REQUEST_KEYS, "")
        request_id = body.get("id")
        for key in ("id", "model_name"):
            if body.get(key) is not None and not isinstance(body[key], str):
                raise BadRequest(key, f"must be a string, got {json_type(body[key])}")
        parameters = _parameters(body, "parameters")
        tensors = self._tensors(body.get("inputs"), binary)
        rows = self._rows(tensors)
        inputs: dict[str, Any] = {self.schema.jagged.name: rows.ids}
        if not self.embeddings:
            inputs[self.schema.rows.name] = rows.dense
        if self.schema.context is not None:
            context = self._array(tensors, "context", FLOAT_TYPES, (1, self.schema.context_features))
            inputs[self.schema.context.name] = torch.from_numpy(context)
        hashed = rows.hashed_ids
        if self.schema.context_jagged is not None:
            inputs[self.schema.context_jagged.name], context_hashed = self._context_ids(tensors)
            hashed += context_hashed
        outputs, binary_outputs = self._outputs(body.get("outputs"), parameters.get("binary_data_output"))
        bags = self._bags(tensors, rows.ids.lengths.numpy()) if self.names["bags"] in tensors else None
        encoder = V2Encoder(
            self.model_name, request_id, outputs, binary_outputs, bags, self.schema.embedding_widths,
            self.model_version,
        )
        return DecodedRequest(RequestInputs(rows.dense.shape[0], inputs), encoder, hashed)

    @staticmethod
    def key_count(body: dict) -> int:
        """Keys in all objects of a body this decoder accepted (``json_values.refuse_duplicate_keys``)."""
        count = len(body) + len(body.get("parameters", ()))
        for tensor in [*body["inputs"], *body.get("outputs", ())]:
            count += len(tensor) + len(tensor.get("parameters", ()))
        return count

    # -- the named tensors ------------------------------------------------------------------------

    def _tensors(self, raw: Any, binary: memoryview | None) -> dict[str, _Tensor]:
        """``inputs`` -> {name: tensor}, each checked for its own keys; binary tensors take their
        bytes from ``binary`` in order, which they must use up exactly."""
        if not isinstance(raw, list) or not raw:
            raise BadRequest("inputs", "must be a non-empty list of tensors", "missing_field")
        tensors: dict[str, _Tensor] = {}
        offset = 0
        for i, tensor in enumerate(raw):
            field = f"inputs[{i}]"
            if not isinstance(tensor, dict):
                raise BadRequest(field, f"must be an object, got {json_type(tensor)}")
            reject_unknown(tensor, _TENSOR_KEYS, f"{field}.")
            name = tensor.get("name")
            if name not in self.known:
                raise BadRequest(
                    f"{field}.name",
                    f"unknown input {name!r} (this model takes {', '.join(sorted(self.known))})",
                    "unknown_field",
                )
            if name in tensors:
                raise BadRequest(f"{field}.name", f"input {name!r} is given twice")
            field = f"{field} ({name})"
            for key in ("shape", "datatype"):
                if key not in tensor:
                    raise BadRequest(f"{field}.{key}", "required", "missing_field")
            size = _parameters(tensor, f"{field}.parameters").get("binary_data_size")
            piece = None
            if size is not None:
                if "data" in tensor:
                    raise BadRequest(f"{field}.data", "a binary tensor (binary_data_size) has no data")
                if binary is None:
                    raise BadRequest(
                        f"{field}.parameters.binary_data_size",
                        f"binary data needs the {HEADER_LENGTH} header (the JSON header's length)",
                        "malformed_body",
                    )
                if type(size) is not int or size < 0 or offset + size > len(binary):
                    raise BadRequest(
                        f"{field}.parameters.binary_data_size",
                        f"{size!r} bytes from byte {offset} of {len(binary)} after the header: the "
                        "body is shorter than the header says",
                        "malformed_body",
                    )
                piece, offset = binary[offset : offset + size], offset + size
            elif "data" not in tensor:
                raise BadRequest(f"{field}.data", "required (or binary_data_size)", "missing_field")
            tensors[name] = _Tensor(field, tensor["datatype"], tensor["shape"], tensor.get("data"), piece)
        if binary is not None and offset != len(binary):
            raise BadRequest(
                "body",
                f"{len(binary) - offset} bytes after the binary tensors: the header's "
                f"binary_data_size add up to {offset} of {len(binary)}",
                "malformed_body",
            )
        for key in ("dense", "lengths", "values", "context", "context_lengths", "context_values"):
            name = self.names[key]
            if name is not None and name not in tensors:
                raise BadRequest("inputs", f"input {name!r} is required", "missing_field")
        return tensors

    def _rows(self, tensors: dict[str, _Tensor]) -> DecodedRows:
        num_features = len(self.schema.features)
        if self.embeddings:  # ids only: the lengths [F, n] say how many items
            lengths = self._array(tensors, "lengths", INT_TYPES, (num_features, None), items_axis=1)
            num_items = lengths.shape[1]
            self.checks.item_count(tensors[self.names["lengths"]].field, num_items)
            dense = np.zeros((num_items, 0), dtype=np.float32)
        else:
            dense = self._array(tensors, "dense", FLOAT_TYPES, (None, self.schema.dense_features))
            num_items = dense.shape[0]
            self.checks.item_count(tensors[self.names["dense"]].field, num_items)
            lengths = self._array(tensors, "lengths", INT_TYPES, (num_features, num_items))
        if (lengths < 0).any():
            raise BadRequest(tensors[self.names["lengths"]].field, "lengths must be >= 0")
        values = tensors[self.names["values"]]
        names = self.schema.feature_names

        def field_of(f: int, i: int, j: int | None) -> str:
            spot = f"feature {names[f]}, item {i}" + ("" if j is None else f", id {j}")
            return f"{values.field} ({spot})"

        ids = self._array(
            tensors, "values", INT_TYPES, (int(lengths.sum()),),
            lambda k: field_of(*bag_position(lengths, k)),
        )
        ids, hashed = self.checks.ids(ids, lengths, field_of)
        weights = None
        if self.schema.weighted_ids:
            weights = (
                self._array(tensors, "weights", FLOAT_TYPES, (len(ids),))
                if self.names["weights"] in tensors
                else np.ones(len(ids), dtype=np.float32)
            )
        return DecodedRows.from_arrays(dense, lengths, ids, weights, hashed)

    def _context_ids(self, tensors: dict[str, _Tensor]) -> tuple[JaggedIds, int]:
        """The request's per-request ids: lengths [F', 1] and their values."""
        lengths = self._array(tensors, "context_lengths", INT_TYPES, (len(self.schema.context_sparse), 1))
        if (lengths < 0).any():
            raise BadRequest(tensors[self.names["context_lengths"]].field, "lengths must be >= 0")
        values = tensors[self.names["context_values"]]
        names = [f.name for f in self.schema.context_sparse]

        def field_of(f: int, _: int, j: int | None) -> str:
            return f"{values.field} (feature {names[f]}" + ("" if j is None else f", id {j}") + ")"

        ids = self._array(
            tensors, "context_values", INT_TYPES, (int(lengths.sum()),), lambda k: field_of(*bag_position(lengths, k))
        )
        ids, hashed = self.checks.context_ids(ids, lengths, field_of)
        return JaggedIds(lengths=as_tensor(np.ascontiguousarray(lengths)), values=as_tensor(ids)), hashed

    def _bags(self, tensors: dict[str, _Tensor], lengths: np.ndarray) -> tuple[int, ...]:
        """An embedding shard's ``bags`` [F]: how many leading items of each feature hold its bags
        (and are answered); every item after them must be an empty bag."""
        field = tensors[self.names["bags"]].field
        bags = self._array(tensors, "bags", INT_TYPES, (len(self.schema.features),))
        num_items = lengths.shape[1]
        if ((bags < 0) | (bags > num_items)).any():
            raise BadRequest(field, f"each must be in [0, {num_items}] (the items), got {bags.tolist()}")
        past = np.arange(num_items)[None, :] >= bags[:, None]
        if (lengths[past] != 0).any():
            f, i = np.argwhere(past & (lengths != 0))[0]
            raise BadRequest(
                f"{tensors[self.names['lengths']].field} (feature {self.schema.feature_names[f]}, item {i})",
                f"must be 0: the feature's bags end at item {bags[f]} (bags), so this one would not be answered",
            )
        return tuple(bags.tolist())

    def _array(
        self,
        tensors: dict[str, _Tensor],
        key: str,
        datatypes: dict[str, str],
        expected: tuple[int | None, ...],
        locate: Any = None,
        items_axis: int = 0,
    ) -> np.ndarray:
        """The tensor as float32 (``FLOAT_TYPES``) or int64 (``INT_TYPES``) of its declared shape,
        checked against ``expected`` (None: any size; on ``items_axis``, at least one)."""
        tensor = tensors[self.names[key]]
        field = tensor.field
        floats = datatypes is FLOAT_TYPES
        allowed = {**FLOAT_TYPES, **INT_TYPES} if floats else INT_TYPES  # ints are numbers too
        if tensor.datatype not in allowed:
            raise BadRequest(f"{field}.datatype", f"must be one of {sorted(allowed)}, got {tensor.datatype!r}")
        shape = _shape(field, tensor.shape, expected, items_axis)
        count = math.prod(shape)
        locate = locate or (lambda k: f"{field}.data[{k}]")
        if tensor.raw is None:
            flat = _flatten(field, tensor.data)
            if len(flat) != count:
                raise BadRequest(f"{field}.data", f"shape {list(shape)} needs {count} values, got {len(flat)}")
            values = finite_float32s(flat, locate) if floats else int_array(flat, locate)
            return values.reshape(shape)
        dtype = np.dtype(allowed[tensor.datatype])
        if len(tensor.raw) != count * dtype.itemsize:
            raise BadRequest(
                f"{field}.parameters.binary_data_size",
                f"shape {list(shape)} of {tensor.datatype} needs {count * dtype.itemsize} bytes, "
                f"got {len(tensor.raw)}",
                "malformed_body",
            )
        values = np.frombuffer(tensor.raw, dtype=dtype).reshape(shape)
        if floats:
            values = values.astype(np.float32, copy=False)
            if not np.isfinite(values).all():
                k = int(np.argmax(~np.isfinite(values.reshape(-1))))
                raise BadRequest(locate(k), f"must be finite in float32, got {values.reshape(-1)[k]}")
            return values
        if dtype == np.uint64 and (values > np.iinfo(np.int64).max).any():
            k = int(np.argmax(values.reshape(-1) > np.iinfo(np.int64).max))
            raise BadRequest(locate(k), f"integer {values.reshape(-1)[k]} is out of int64 range")
        return values.astype(np.int64, copy=False)

    def _outputs(self, raw: Any, all_binary: Any) -> tuple[tuple[str, ...], frozenset[str]]:
        if all_binary is not None and not isinstance(all_binary, bool):
            raise BadRequest("parameters.binary_data_output", f"must be true or false, got {all_binary!r}")
        allowed = (EMBEDDINGS,) if self.embeddings else OUTPUTS
        if raw is None:
            default = self.default_output
            return (default,), frozenset({default} if all_binary else ())
        if not isinstance(raw, list) or not raw:
            raise BadRequest("outputs", "must be a non-empty list of {\"name\": ...}")
        names, binary = [], set()
        for i, output in enumerate(raw):
            if not isinstance(output, dict):
                raise BadRequest(f"outputs[{i}]", f"must be an object, got {json_type(output)}")
            reject_unknown(output, _OUTPUT_KEYS, f"outputs[{i}].")
            name = output.get("name")
            if name not in allowed:
                raise BadRequest(f"outputs[{i}].name", f"must be one of {list(allowed)}, got {name!r}")
            wants = _parameters(output, f"outputs[{i}].parameters").get("binary_data", all_binary)
            if wants is not None and not isinstance(wants, bool):
                raise BadRequest(f"outputs[{i}].parameters.binary_data", f"must be true or false, got {wants!r}")
            names.append(name)
            if wants:
                binary.add(name)
        return tuple(names), frozenset(binary)


def _parameters(obj: dict, field: str) -> dict:
    parameters = obj.get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest(field, f"must be an object, got {json_type(parameters)}")
    return parameters


def _shape(field: str, shape: Any, expected: tuple[int | None, ...], items_axis: int = 0) -> tuple[int, ...]:
    """The declared shape, checked against ``expected`` (None: any size; on ``items_axis``, the
    items, at least one)."""
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise BadRequest(f"{field}.shape", f"must be a list of sizes, got {shape!r}")
    if len(shape) != len(expected) or any(e is not None and d != e for d, e in zip(shape, expected)):
        wanted = "[" + ", ".join("n" if e is None else str(e) for e in expected) + "]"
        raise BadRequest(f"{field}.shape", f"must be {wanted}, got {shape}")
    if expected[items_axis] is None and shape[items_axis] == 0:
        raise BadRequest(f"{field}.shape", "must hold at least one item")
    return tuple(shape)


def _flatten(field: str, data: Any) -> list:
    """JSON ``data``, flat or nested row-major -> a flat list."""
    if not isinstance(data, list):
        raise BadRequest(f"{field}.data", f"must be a list, got {json_type(data)}")
    while data and isinstance(data[0], list):
        if not all(isinstance(row, list) for row in data):
            raise BadRequest(f"{field}.data", "nested rows must all be lists")
        data = list(itertools.chain.from_iterable(data))
    return data
