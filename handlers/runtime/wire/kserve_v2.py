"""The KServe v2 / Open Inference Protocol request, as KServe's and Triton's clients send it to
``POST /v2/models/{name}/infer`` (TorchServe routes it to the handler unchanged).

The model's inputs are named tensors, laid out as the batch tags lay them out (``F`` features,
``n`` items)::

    {"id": "r1",                                     # optional, echoed back
     "inputs": [
       {"name": "dense_features", "datatype": "FP32", "shape": [n, D], "data": [...]},
       {"name": "sparse_features.lengths", "datatype": "INT64", "shape": [F, n], "data": [...]},
       {"name": "sparse_features.values", "datatype": "INT64", "shape": [V], "data": [...]},
       {"name": "sparse_features.weights", "datatype": "FP32", "shape": [V], "data": [...]},
       {"name": "context_features", "datatype": "FP32", "shape": [1, C], "data": [...]}],
     "outputs": [{"name": "scores"}, {"name": "logits"}]}   # optional; default: scores

``weights`` only for a model with weighted ids (optional: 1), ``context_features`` only for a model
with a context input. ``data`` is row-major, flat or nested. The answer::

    {"model_name": "criteo", "id": "r1",
     "outputs": [{"name": "scores", "datatype": "FP32", "shape": [n], "data": [...]}]}

and an error is ``{"error": "<field>: <problem>"}`` with its 4xx status.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
import orjson
import torch

from handlers.runtime.errors import BadRequest, ServingError
from handlers.runtime.inputs import InputSchema, RequestInputs
from handlers.runtime.validation import RequestChecks, bag_position
from handlers.runtime.wire.json_values import finite_float32s, int_array, json_type, reject_unknown
from handlers.runtime.wire.messages import DecodedRequest, DecodedRows, Response

FLOAT_TYPES = frozenset({"FP16", "FP32", "FP64"})
INT_TYPES = frozenset({"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"})
OUTPUTS = ("scores", "logits")
_REQUEST_KEYS = frozenset({"id", "parameters", "inputs", "outputs"})
_TENSOR_KEYS = frozenset({"name", "shape", "datatype", "parameters", "data"})


@dataclasses.dataclass(frozen=True)
class V2Encoder:
    """Answers in the v2 form: the requested outputs as FP32 tensors of shape [n]."""

    model_name: str
    request_id: str | None = None
    outputs: tuple[str, ...] = ("scores",)

    def scores(self, logits: torch.Tensor) -> Response:
        values = {"scores": torch.sigmoid(logits), "logits": logits}
        body: dict[str, Any] = {"model_name": self.model_name}
        if self.request_id is not None:
            body["id"] = self.request_id
        body["outputs"] = [
            {"name": name, "datatype": "FP32", "shape": [len(logits)], "data": values[name].tolist()}
            for name in self.outputs
        ]
        return Response(200, orjson.dumps(body))

    def error(self, error: ServingError) -> Response:
        return Response(error.status, orjson.dumps({"error": error.message}))


class V2Decoder:
    """A parsed v2 request body -> the request's inputs, answered by a ``V2Encoder``."""

    def __init__(self, schema: InputSchema, checks: RequestChecks, model_name: str) -> None:
        self.schema = schema
        self.checks = checks
        self.model_name = model_name
        jagged = schema.jagged.name
        self.names = {
            "dense": schema.rows.name,
            "lengths": f"{jagged}.lengths",
            "values": f"{jagged}.values",
            "weights": f"{jagged}.weights",
            "context": schema.context.name if schema.context else None,
        }
        known = {n for key, n in self.names.items() if n and (key != "weights" or schema.weighted_ids)}
        self.known = frozenset(known)

    def encoder(self, body: dict) -> V2Encoder:
        """How to answer ``body``, as far as it can be read (errors need no more than this)."""
        request_id = body.get("id")
        return V2Encoder(self.model_name, request_id if isinstance(request_id, str) else None)

    def decode(self, body: dict) -> DecodedRequest:
        reject_unknown(body, _REQUEST_KEYS, "")
        request_id = body.get("id")
        if request_id is not None and not isinstance(request_id, str):
            raise BadRequest("id", f"must be a string, got {json_type(request_id)}")
        tensors = self._tensors(body.get("inputs"))
        rows = self._rows(tensors)
        inputs: dict[str, Any] = {self.schema.rows.name: rows.dense, self.schema.jagged.name: rows.ids}
        if self.schema.context is not None:
            context = self._floats(tensors, "context", (1, self.schema.context_features))
            inputs[self.schema.context.name] = torch.from_numpy(context)
        encoder = V2Encoder(self.model_name, request_id, self._outputs(body.get("outputs")))
        return DecodedRequest(RequestInputs(rows.dense.shape[0], inputs), encoder, rows.hashed_ids)

    # -- the named tensors ------------------------------------------------------------------------

    def _tensors(self, raw: Any) -> dict[str, tuple[str, dict]]:
        """``inputs`` -> {name: (its field path, the tensor)}, each checked for its own keys."""
        if not isinstance(raw, list) or not raw:
            raise BadRequest("inputs", "must be a non-empty list of tensors", "missing_field")
        tensors: dict[str, tuple[str, dict]] = {}
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
            for key in ("shape", "datatype", "data"):
                if key not in tensor:
                    raise BadRequest(f"{field}.{key}", "required", "missing_field")
            tensors[name] = (f"{field} ({name})", tensor)
        for key in ("dense", "lengths", "values", "context"):
            name = self.names[key]
            if name is not None and name not in tensors:
                raise BadRequest("inputs", f"input {name!r} is required", "missing_field")
        return tensors

    def _rows(self, tensors: dict[str, tuple[str, dict]]) -> DecodedRows:
        num_features = len(self.schema.features)
        values_field, values_tensor = tensors[self.names["values"]]
        dense = self._floats(tensors, "dense", (None, self.schema.dense_features))
        num_items = dense.shape[0]
        self.checks.item_count(tensors[self.names["dense"]][0], num_items)
        lengths = self._ints(tensors, "lengths", (num_features, num_items))
        if (lengths < 0).any():
            raise BadRequest(tensors[self.names["lengths"]][0], "lengths must be >= 0")
        flat_values = self._flat(values_field, values_tensor, INT_TYPES)
        self._check_shape(values_field, values_tensor, flat_values, (int(lengths.sum()),))
        names = self.schema.feature_names

        def field_of(f: int, i: int, j: int | None) -> str:
            spot = f"feature {names[f]}, item {i}" + ("" if j is None else f", id {j}")
            return f"{values_field} ({spot})"

        ids = int_array(flat_values, lambda k: field_of(*bag_position(lengths, k)))
        ids, hashed = self.checks.ids(ids, lengths, field_of)
        weights = None
        if self.schema.weighted_ids:
            weights = (
                self._floats(tensors, "weights", (len(ids),))
                if self.names["weights"] in tensors
                else np.ones(len(ids), dtype=np.float32)
            )
        return DecodedRows.from_arrays(dense, lengths, ids, weights, hashed)

    def _floats(self, tensors: dict, key: str, shape: tuple[int | None, ...]) -> np.ndarray:
        field, tensor = tensors[self.names[key]]
        flat = self._flat(field, tensor, FLOAT_TYPES | INT_TYPES)
        values = finite_float32s(flat, lambda k: f"{field}.data[{k}]")
        return values.reshape(self._check_shape(field, tensor, flat, shape))

    def _ints(self, tensors: dict, key: str, shape: tuple[int | None, ...]) -> np.ndarray:
        field, tensor = tensors[self.names[key]]
        flat = self._flat(field, tensor, INT_TYPES)
        values = int_array(flat, lambda k: f"{field}.data[{k}]")
        return values.reshape(self._check_shape(field, tensor, flat, shape))

    @staticmethod
    def _flat(field: str, tensor: dict, datatypes: frozenset[str]) -> list:
        datatype = tensor["datatype"]
        if datatype not in datatypes:
            raise BadRequest(f"{field}.datatype", f"must be one of {sorted(datatypes)}, got {datatype!r}")
        data = tensor["data"]
        if not isinstance(data, list):
            raise BadRequest(f"{field}.data", f"must be a list, got {json_type(data)}")
        while data and isinstance(data[0], list):  # nested, row-major
            if not all(isinstance(row, list) for row in data):
                raise BadRequest(f"{field}.data", "nested rows must all be lists")
            data = list(itertools.chain.from_iterable(data))
        return data

    @staticmethod
    def _check_shape(
        field: str, tensor: dict, flat: list, expected: tuple[int | None, ...]
    ) -> tuple[int, ...]:
        """The tensor's declared shape, checked against ``expected`` (None: any size) and against
        the number of values it holds."""
        shape = tensor["shape"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise BadRequest(f"{field}.shape", f"must be a list of sizes, got {shape!r}")
        if len(shape) != len(expected) or any(e is not None and d != e for d, e in zip(shape, expected)):
            wanted = "[" + ", ".join("n" if e is None else str(e) for e in expected) + "]"
            raise BadRequest(f"{field}.shape", f"must be {wanted}, got {shape}")
        if math.prod(shape) != len(flat):
            raise BadRequest(
                f"{field}.data", f"shape {shape} needs {math.prod(shape)} values, got {len(flat)}"
            )
        if expected[0] is None and shape[0] == 0:
            raise BadRequest(f"{field}.shape", "must hold at least one item")
        return tuple(shape)

    def _outputs(self, raw: Any) -> tuple[str, ...]:
        if raw is None:
            return ("scores",)
        if not isinstance(raw, list) or not raw:
            raise BadRequest("outputs", "must be a non-empty list of {\"name\": ...}")
        names = []
        for i, output in enumerate(raw):
            name = output.get("name") if isinstance(output, dict) else None
            if name not in OUTPUTS:
                raise BadRequest(f"outputs[{i}].name", f"must be one of {list(OUTPUTS)}, got {name!r}")
            names.append(name)
        return tuple(names)
