"""The scoring service: a TorchServe batch of K request bodies -> K responses.

``handle`` is decode -> coalesce -> run -> split -> encode; each stage is a function of its own module.
It knows nothing about TorchServe (``handlers.torchserve_handler`` adapts it), so tests drive it
in-process with the same bodies the server receives.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import orjson
import torch

from handlers.runtime.artifacts import Runner
from handlers.runtime.batching import chunk_by_items, coalesce, padding_request, split_outputs
from handlers.runtime.errors import InternalError, ServingError
from handlers.runtime.inputs import InputSchema, RequestInputs
from handlers.runtime.wire.json_request import DecodedRequest, RequestDecoder

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Response:
    status: int
    body: bytes


@dataclasses.dataclass(frozen=True)
class HandledBatch:
    """One response per request, in order, and the items of each forward that answered them."""

    responses: list[Response]
    forward_items: list[int]


class ScoringService:
    """Scores requests with one model (any artifact's runner); one response per request, in order.

    A batch smaller than ``schema.min_requests`` (a graph captured with TorchAO's int8 dynamic
    quantization takes 2) is padded with empty requests, whose outputs are dropped.
    """

    def __init__(self, schema: InputSchema, model: Runner) -> None:
        self.schema = schema
        self.model = model
        self.decoder = RequestDecoder(schema)
        self.tags = schema.tags

    def handle(self, payloads: Sequence[Any]) -> HandledBatch:
        responses: list[Response | None] = [None] * len(payloads)
        decoded: list[tuple[int, DecodedRequest]] = []
        for index, payload in enumerate(payloads):
            try:
                decoded.append((index, self.decoder.decode(payload)))
            except ServingError as e:
                responses[index] = _error_response(e)
        requests = [d.inputs for _, d in decoded]
        forward_items = []
        for chunk in chunk_by_items(requests, self.schema.limits.max_items_per_forward):
            forward_items.append(sum(requests[i].num_items for i in chunk))
            try:
                logits = self.logits([requests[i] for i in chunk])
            except Exception:  # the model failed on validated input: a bug, not the client's
                logger.exception("forward failed for a chunk of %d requests", len(chunk))
                for i in chunk:
                    responses[decoded[i][0]] = _error_response(InternalError("model forward failed"))
                continue
            for i, request_logits in zip(chunk, logits):
                index, request = decoded[i]
                responses[index] = _scores_response(request_logits, request.return_logits)
        return HandledBatch(responses, forward_items)  # type: ignore[arg-type]  # all answered

    def logits(self, requests: Sequence[RequestInputs]) -> list[torch.Tensor]:
        """One forward over all items of ``requests``; logits [n_k] per request."""
        padded = list(requests)
        missing = self.schema.min_requests - len(padded)
        if missing > 0:
            padded += [padding_request(requests[0], self.tags)] * missing
        batch = coalesce(padded, self.tags)
        with torch.inference_mode():
            output = self.model(batch).reshape(-1).cpu()
        counts = [r.num_items for r in requests]
        return split_outputs(output[: sum(counts)], counts)


def _scores_response(logits: torch.Tensor, return_logits: bool) -> Response:
    body: dict[str, list[float]] = {"scores": torch.sigmoid(logits).tolist()}
    if return_logits:
        body["logits"] = logits.tolist()
    return Response(200, orjson.dumps(body))


def _error_response(error: ServingError) -> Response:
    return Response(error.status, orjson.dumps(error.to_body()))
