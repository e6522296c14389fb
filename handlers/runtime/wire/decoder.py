"""Request bodies, decoded in one place: bytes -> ``DecodedRequest`` (typed tensors, and how to
answer), whatever the wire form. The body's keys say which form it is:

* ``items``: the project's items form (``json_items``);
* ``float_features``: TorchRec's columnar form, as TorchServe's DLRM example sends it
  (``json_columnar``), answered with its ``"default"`` logits as well;
* ``inputs``: the KServe v2 / Open Inference Protocol form (``kserve_v2``), answered in v2 form;
  a ``BinaryBody`` is one with binary tensors after its JSON header.

The JSON forms also take ``"context": [C floats]`` once per request for a model with a context
input, and ``"return_logits": true``. Anything else is refused with a ``BadRequest`` naming the
field, e.g. ``items[2].sparse.cat_4[1]``, in the form's own error shape; so is a JSON key given
twice in one object (parsers would keep the last silently). An embedding shard (a schema whose
output is ``embeddings``) is called by the dense host of its layout and takes v2 tensors only.
"""

from __future__ import annotations

from typing import Any

import torch

from handlers.runtime.errors import BadRequest, ServingError
from handlers.runtime.inputs import InputSchema, Output, RequestInputs
from handlers.runtime.validation import RequestChecks
from handlers.runtime.wire.json_columnar import DENSE_KEY, ColumnarDecoder
from handlers.runtime.wire.json_items import ItemsDecoder
from handlers.runtime.wire.json_values import (
    float_rows,
    json_type,
    parse_json,
    refuse_duplicate_keys,
    reject_unknown,
)
from handlers.runtime.wire.kserve_v2 import V2Decoder
from handlers.runtime.wire.v2_answers import HEADER_LENGTH
from handlers.runtime.wire.messages import BinaryBody, DecodedRequest, JsonEncoder, Rejected
from handlers.runtime.wire.transport import Arrival, opened

CONTEXT_KEY = "context"
RETURN_LOGITS_KEY = "return_logits"
V2_KEY = "inputs"


class RequestDecoder:
    """Decodes and validates requests for one model's inputs; ``model_name`` is the name answers
    carry where the protocol names the model (KServe v2)."""

    def __init__(self, schema: InputSchema, model_name: str | None = None) -> None:
        self.schema = schema
        checks = RequestChecks(schema)
        self._v2 = V2Decoder(schema, checks, model_name or schema.model)
        self._v2_only = schema.output == Output.EMBEDDINGS
        if self._v2_only:
            return
        self._items = ItemsDecoder(schema, checks)
        self._columnar = ColumnarDecoder(schema, checks)
        shared = {RETURN_LOGITS_KEY} | ({CONTEXT_KEY} if schema.context else set())
        self._items_keys = frozenset({"items"} | shared)
        self._columnar_keys = self._columnar.keys | shared

    def decode(self, payload: Arrival | BinaryBody | bytes | bytearray | str | dict | list | None) -> DecodedRequest:
        """Raises ``Rejected`` (the error and its answer) for a request it refuses."""
        encoder: Any = JsonEncoder()
        try:
            if isinstance(payload, Arrival):
                payload = opened(payload, self.schema.limits.max_request_bytes)
            binary = None
            if isinstance(payload, BinaryBody):  # only v2 has binary tensors: answer in v2
                encoder = self._v2.encoder({})
                payload, binary = _split_binary(payload)
            body = parse_json(payload)
            if not isinstance(body, dict):
                raise BadRequest("body", f"must be a JSON object, got {json_type(body)}", "malformed_body")
            if V2_KEY in body:
                encoder = self._v2.encoder(body)
                decoded = self._v2.decode(body, binary)
                refuse_duplicate_keys(payload, self._v2.key_count(body))
                return decoded
            if binary is not None:
                raise BadRequest(V2_KEY, "a body with binary tensors is a KServe v2 request", "missing_field")
            if self._v2_only:
                raise BadRequest(
                    V2_KEY, "required: an embedding shard takes KServe v2 tensors (ids in, embeddings out)",
                    "missing_field",
                )
            decoded = self._decode_json(body)
            refuse_duplicate_keys(payload, self._items.key_count(body) if "items" in body else len(body))
            return decoded
        except ServingError as error:
            raise Rejected(error, encoder) from None

    def _decode_json(self, body: dict) -> DecodedRequest:
        return_logits = body.get(RETURN_LOGITS_KEY, False)
        if not isinstance(return_logits, bool):
            raise BadRequest(RETURN_LOGITS_KEY, f"must be true or false, got {return_logits!r}")
        if "items" in body:
            reject_unknown(body, self._items_keys, "")
            rows = self._items.decode(body["items"])
        elif DENSE_KEY in body:
            reject_unknown(body, self._columnar_keys, "")
            rows = self._columnar.decode(body)
        else:
            raise BadRequest(
                "items",
                "required (or the columnar form with float_features and id_list_features, or "
                "KServe v2 inputs)",
                "missing_field",
            )
        tensors: dict[str, Any] = {self.schema.rows.name: rows.dense, self.schema.jagged.name: rows.ids}
        context = self.schema.context
        if context is not None:
            tensors[context.name] = self._context(body.get(CONTEXT_KEY))
        encoder = JsonEncoder(return_logits=return_logits, default=DENSE_KEY in body)
        inputs = RequestInputs(rows.dense.shape[0], tensors)
        return DecodedRequest(inputs, encoder, rows.hashed_ids)

    def _context(self, row: Any) -> torch.Tensor:
        """The request's context row -> float32 [1, C]."""
        width = self.schema.context_features
        if row is None:
            raise BadRequest(CONTEXT_KEY, f"required: a list of {width} numbers", "missing_field")
        return torch.from_numpy(float_rows([row], width, lambda _: CONTEXT_KEY))


def _split_binary(body: BinaryBody) -> tuple[memoryview, memoryview]:
    """(the JSON header, the binary tensors after it), both views into the body."""
    data = memoryview(body.data)
    if not 0 < body.json_length <= len(data):
        raise BadRequest(
            HEADER_LENGTH,
            f"must be the JSON header's length, 1 to the body's {len(data)} bytes, got {body.json_length}",
            "malformed_body",
        )
    return data[: body.json_length], data[body.json_length :]
