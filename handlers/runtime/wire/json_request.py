"""JSON request bodies, decoded in one place: bytes -> ``DecodedRequest`` (typed tensors).

Two forms are accepted (the README documents both): the items form (``json_items``) and
TorchRec's columnar form (``json_columnar``). A model with a context input also takes
``"context": [C floats]`` once per request; any body may ask for ``"return_logits": true``.

Anything else is a ``BadRequest`` naming the field, e.g. ``items[2].sparse.cat_4[1]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import InputSchema, RequestInputs
from handlers.runtime.validation import RequestChecks
from handlers.runtime.wire.json_columnar import DENSE_KEY, ColumnarDecoder
from handlers.runtime.wire.json_items import ItemsDecoder
from handlers.runtime.wire.json_values import float_rows, json_type, parse_json, reject_unknown

CONTEXT_KEY = "context"
RETURN_LOGITS_KEY = "return_logits"


@dataclasses.dataclass(frozen=True)
class DecodedRequest:
    inputs: RequestInputs
    return_logits: bool


class RequestDecoder:
    """Decodes and validates JSON requests for one model's inputs."""

    def __init__(self, schema: InputSchema) -> None:
        self.schema = schema
        checks = RequestChecks(schema)
        self._items = ItemsDecoder(schema, checks)
        self._columnar = ColumnarDecoder(schema, checks)
        shared = {RETURN_LOGITS_KEY} | ({CONTEXT_KEY} if schema.context else set())
        self._items_keys = frozenset({"items"} | shared)
        self._columnar_keys = self._columnar.keys | shared

    def decode(self, payload: bytes | bytearray | str | dict | list | None) -> DecodedRequest:
        body = parse_json(payload)
        if not isinstance(body, dict):
            raise BadRequest("body", f"must be a JSON object, got {json_type(body)}")
        return_logits = body.get(RETURN_LOGITS_KEY, False)
        if not isinstance(return_logits, bool):
            raise BadRequest(RETURN_LOGITS_KEY, f"must be true or false, got {return_logits!r}")
        if "items" in body:
            reject_unknown(body, self._items_keys, "")
            dense, ids = self._items.decode(body["items"])
        elif DENSE_KEY in body:
            reject_unknown(body, self._columnar_keys, "")
            dense, ids = self._columnar.decode(body)
        else:
            raise BadRequest(
                "items", "required (or the columnar form with float_features and id_list_features)"
            )
        tensors: dict[str, Any] = {self.schema.rows.name: dense, self.schema.jagged.name: ids}
        context = self.schema.context
        if context is not None:
            tensors[context.name] = self._context(body.get(CONTEXT_KEY))
        return DecodedRequest(RequestInputs(dense.shape[0], tensors), return_logits=return_logits)

    def _context(self, row: Any) -> torch.Tensor:
        """The request's context row -> float32 [1, C]."""
        width = self.schema.context_features
        if row is None:
            raise BadRequest(CONTEXT_KEY, f"required: a list of {width} numbers")
        return torch.from_numpy(float_rows([row], width, lambda _: CONTEXT_KEY))
