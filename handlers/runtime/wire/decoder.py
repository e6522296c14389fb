"""Request bodies, decoded in one place: bytes -> ``DecodedRequest`` (typed tensors, and how to
answer), whatever the wire form. The body's keys say which form it is:

* ``items``: the project's items form (``json_items``);
* ``float_features``: TorchRec's columnar form, as TorchServe's DLRM example sends it
  (``json_columnar``), answered with its ``"default"`` logits as well;
* ``inputs``: the KServe v2 / Open Inference Protocol form (``kserve_v2``), answered in v2 form;
  a ``BinaryBody`` is one with binary tensors after its JSON header.

The JSON forms also take ``"context": [C floats]`` once per request for a model with a context
input, ``"context_sparse": {feature: [ids]}`` for one with per-request ids (``json_context_ids``),
and ``"return_logits": true``. Anything else is refused with a ``BadRequest`` naming the
field, e.g. ``items[2].sparse.cat_4[1]``, in the form's own error shape; so is a JSON key given
twice in one object (parsers would keep the last silently). An embedding shard (a schema whose
output is ``embeddings``) is called by the dense host of its layout and takes v2 tensors only.

A TorchServe batch goes through ``decode_batch``: each request is read alone (JSON, shape, keys),
and the arrays of consecutive requests of one JSON form (items, or columnar) are made together, so
the numpy calls and the value checks are paid once per batch, not once per request (a one-item
request's decoding cost them half its time), and the forward's inputs come as one part.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence, Union

import torch

from handlers.runtime.errors import BadRequest, ServingError
from handlers.runtime.inputs import InputSchema, Output, RequestInputs
from handlers.runtime.validation import RequestChecks
from handlers.runtime.wire.json_columnar import DENSE_KEY, ColumnarDecoder, SentColumns
from handlers.runtime.wire.json_context_ids import CONTEXT_SPARSE_KEY, ContextIdsDecoder
from handlers.runtime.wire.json_items import ItemsDecoder, SentItems
from handlers.runtime.wire.json_values import (
    float_rows,
    json_type,
    parse_json,
    refuse_duplicate_keys,
    reject_unknown,
)
from handlers.runtime.wire.kserve_v2 import V2Decoder
from handlers.runtime.wire.v2_headers import HEADER_LENGTH
from handlers.runtime.wire.messages import (
    BinaryBody,
    DecodedBatch,
    DecodedPart,
    DecodedRequest,
    DecodedRows,
    JsonEncoder,
    Rejected,
)
from handlers.runtime.wire.transport import Arrival, opened

CONTEXT_KEY = "context"
RETURN_LOGITS_KEY = "return_logits"
V2_KEY = "inputs"

_JSON_ENCODERS = {(logits, default): JsonEncoder(logits, default) for logits in (False, True) for default in (False, True)}

Payload = Union[Arrival, BinaryBody, bytes, bytearray, str, dict, list, None]


class _Sent(NamedTuple):
    """A JSON request (items or columnar form) read for shape; its arrays are made with its
    neighbours' of the same form (``decode_batch``)."""

    items: SentItems | SentColumns
    context: Any  # the context row as sent, for a model with a context input
    context_ids: Any  # its per-request sequences (ContextIdsDecoder.parse), for a model with them
    encoder: JsonEncoder
    num_items: int


class RequestDecoder:
    """Decodes and validates requests for one model's inputs; ``model_name`` and ``model_version``
    are what answers carry where the protocol names the model (KServe v2)."""

    def __init__(self, schema: InputSchema, model_name: str | None = None, model_version: str | None = None) -> None:
        self.schema = schema
        checks = RequestChecks(schema)
        self._v2 = V2Decoder(schema, checks, model_name or schema.model, model_version)
        self._v2_only = schema.output == Output.EMBEDDINGS
        if self._v2_only:
            return
        self._rows_name, self._ids_name = schema.rows.name, schema.jagged.name
        self._context = schema.context
        self._context_jagged = schema.context_jagged
        self._items = ItemsDecoder(schema, checks)
        self._columnar = ColumnarDecoder(schema, checks)
        self._context_ids = ContextIdsDecoder(schema, checks)
        shared = {RETURN_LOGITS_KEY} | ({CONTEXT_KEY} if schema.context else set())
        shared |= {CONTEXT_SPARSE_KEY} if schema.context_jagged else set()
        self._items_keys = frozenset({"items"} | shared)
        self._columnar_keys = self._columnar.keys | shared

    def decode(self, payload: Payload) -> DecodedRequest:
        """One request, decoded alone; raises ``Rejected`` (the error and its answer) if refused."""
        sent = self._read(payload)
        if isinstance(sent, DecodedRequest):
            return sent
        try:
            inputs, hashed = self._arrays([sent])
        except ServingError as error:
            raise Rejected(error, sent.encoder) from None
        return DecodedRequest(inputs, sent.encoder, hashed)

    def decode_batch(self, payloads: Sequence[Payload], max_items: int) -> DecodedBatch:
        """A TorchServe batch, each request read alone; consecutive requests of one JSON form get
        their arrays made together, at most ``max_items`` items to a part. A part whose values hold a
        refusal is decoded again request by request, so that each gets its own answer."""
        batch = DecodedBatch()
        run: list[tuple[int, _Sent]] = []
        run_items = 0
        for index, payload in enumerate(payloads):
            try:
                sent = self._read(payload)
            except Rejected as refusal:
                batch.refused.append((index, refusal))
                continue
            if isinstance(sent, DecodedRequest):
                self._add_run(run, batch)
                run_items = 0
                batch.parts.append(DecodedPart([index], sent.inputs, [sent.encoder], sent.hashed_ids))
                continue
            other_form = bool(run) and type(sent.items) is not type(run[0][1].items)
            if run and (run_items + sent.num_items > max_items or other_form):
                self._add_run(run, batch)
                run_items = 0
            run.append((index, sent))
            run_items += sent.num_items
        self._add_run(run, batch)
        return batch

    def _add_run(self, run: list[tuple[int, "_Sent"]], batch: DecodedBatch) -> None:
        """Adds the run's part (or, if it holds a refusal, each request's) to ``batch``; empties ``run``."""
        if not run:
            return
        sent = [s for _, s in run]
        try:
            inputs, hashed = self._arrays(sent)
            batch.parts.append(DecodedPart([i for i, _ in run], inputs, [s.encoder for s in sent], hashed))
        except ServingError as error:
            if len(run) == 1:
                batch.refused.append((run[0][0], Rejected(error, sent[0].encoder)))
            else:
                for one in run:
                    self._add_run([one], batch)
        run.clear()

    def _read(self, payload: Payload) -> "DecodedRequest | _Sent":
        """The request read: decoded (KServe v2), or a JSON-form one read for shape."""
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
            read = self._read_json(body)
            nested = self._context_sparse_keys(body)
            item_keys = read.items.keys if isinstance(read.items, SentItems) else 0
            refuse_duplicate_keys(payload, len(body) + nested + item_keys)
            return read
        except ServingError as error:
            raise Rejected(error, encoder) from None

    def _context_sparse_keys(self, body: dict) -> int:
        """Keys of the body's ``context_sparse`` object (0 for a model that takes none)."""
        if self._context_jagged is None:
            return 0
        context_ids = body.get(CONTEXT_SPARSE_KEY)
        return len(context_ids) if isinstance(context_ids, dict) else 0

    def _read_json(self, body: dict) -> _Sent:
        return_logits = body.get(RETURN_LOGITS_KEY, False)
        if not isinstance(return_logits, bool):
            raise BadRequest(RETURN_LOGITS_KEY, f"must be true or false, got {return_logits!r}")
        context = body.get(CONTEXT_KEY)
        if self._context is not None and context is None:
            width = self.schema.context_features
            raise BadRequest(CONTEXT_KEY, f"required: a list of {width} numbers", "missing_field")
        context_ids = self._context_ids.parse(body.get(CONTEXT_SPARSE_KEY)) if self._context_jagged else None
        if "items" in body:
            if not body.keys() <= self._items_keys:
                reject_unknown(body, self._items_keys, "")
            items = self._items.parse(body["items"])
            return _Sent(items, context, context_ids, _JSON_ENCODERS[return_logits, False], len(items.dense))
        if DENSE_KEY in body:
            reject_unknown(body, self._columnar_keys, "")
            columns = self._columnar.parse(body)
            encoder = _JSON_ENCODERS[return_logits, True]
            return _Sent(columns, context, context_ids, encoder, columns.num_items)
        raise BadRequest(
            "items",
            "required (or the columnar form with float_features and id_list_features, or "
            "KServe v2 inputs)",
            "missing_field",
        )

    def _arrays(self, sent: Sequence[_Sent]) -> tuple[RequestInputs, int]:
        """The inputs of all items of ``sent``, and how many ids the out-of-range policy hashed."""
        forms = [s.items for s in sent]  # one form per run
        reader = self._items if isinstance(forms[0], SentItems) else self._columnar
        rows = reader.rows(forms)  # type: ignore[arg-type]
        tensors, hashed = self._tensors(rows, [s.context for s in sent], [s.context_ids for s in sent])
        counts = tuple(s.num_items for s in sent)
        return RequestInputs(sum(counts), tensors, counts if len(sent) > 1 else ()), rows.hashed_ids + hashed

    def _tensors(self, rows: DecodedRows, contexts: list[Any], context_ids: list[Any]) -> tuple[dict[str, Any], int]:
        """The model's inputs: the rows, their ids and (a context model) each request's context
        row and per-request ids; and how many of those ids the out-of-range policy hashed."""
        tensors: dict[str, Any] = {self._rows_name: rows.dense, self._ids_name: rows.ids}
        context = self._context
        if context is not None:
            width = self.schema.context_features
            tensors[context.name] = torch.from_numpy(float_rows(contexts, width, lambda _: CONTEXT_KEY))
        if self._context_jagged is None:
            return tensors, 0
        tensors[self._context_jagged.name], hashed = self._context_ids.jagged(context_ids)
        return tensors, hashed


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
