"""The scoring service: a TorchServe batch of K request bodies -> K responses.

``handle`` is decode -> coalesce -> run -> split -> encode; each stage is a function of its own
module. It knows nothing about TorchServe (``handlers.torchserve_handler`` adapts it), so tests
drive it in-process with the same bodies the server receives. It reports what each batch cost
and held (``BatchStats``), which the handler publishes as metrics.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from handlers.runtime.artifacts import Runner
from handlers.runtime.batching import chunk_by_items, coalesce, padding_request, split_outputs
from handlers.runtime.errors import BadRequest, InternalError, ServingError
from handlers.runtime.inputs import InputSchema, JaggedIds, Output, RequestInputs
from handlers.runtime.pruned_ids import PrunedIdCounter
from handlers.runtime.unseen_ids import UnseenIdCounter
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.messages import Response

logger = logging.getLogger(__name__)

STAGES = ("decode", "coalesce", "forward", "encode")


@dataclasses.dataclass(frozen=True)
class BatchStats:
    """One batch: milliseconds spent in each of ``STAGES``, the items of each forward, the
    requests refused by ``BadRequest`` reason, the ids the out-of-range policy hashed, and per
    pruned table the ids that looked up a zero row. (A raw-id model counts its unseen ids in the
    graph: ``ScoringService.unseen_ids``.)"""

    stage_ms: dict[str, float]
    forward_items: list[int]
    rejected: dict[str, int]
    hashed_ids: int
    pruned_ids: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class HandledBatch:
    """One response per request, in order, and what the batch cost."""

    responses: list[Response]
    stats: BatchStats


class _Stopwatch:
    """Milliseconds per stage, summed over one batch."""

    def __init__(self) -> None:
        self.ms = dict.fromkeys(STAGES, 0.0)

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.ms[stage] += (time.perf_counter() - started) * 1000


class ScoringService:
    """Scores requests with one model (any artifact's runner); one response per request, in order.

    A batch smaller than ``schema.min_requests`` (a graph captured with TorchAO's int8 dynamic
    quantization takes 2) is padded with empty requests, whose outputs are dropped; a batch with
    no id at all (every bag empty) gets one more request, holding one id.
    ``model_name``, ``model_version``: what answers carry where the protocol names the model; ``threads_for``:
    the intra-op threads for a forward of so many items (None: leave torch's setting alone);
    ``pruned_ids``: counts the ids of pruned tables that have no row (a pruned model's).
    ``unseen_ids``: counts the ids of raw-id tables that own no slot (a raw-id model's), read
    by whoever publishes them (``unseen_ids.since_last()``), not per batch.
    """

    def __init__(
        self,
        schema: InputSchema,
        model: Runner,
        model_name: str | None = None,
        threads_for: Callable[[int], int] | None = None,
        model_version: str | None = None,
        pruned_ids: PrunedIdCounter | None = None,
        unseen_ids: UnseenIdCounter | None = None,
    ) -> None:
        self.schema = schema
        self.pruned_ids = pruned_ids
        self.unseen_ids = unseen_ids
        self.model = model
        self.decoder = RequestDecoder(schema, model_name, model_version)
        self.tags = schema.tags
        self.threads_for = threads_for
        self._scores = schema.output == Output.SCORES

    def handle(self, payloads: Sequence[Any]) -> HandledBatch:
        watch = _Stopwatch()
        responses: list[Response | None] = [None] * len(payloads)
        rejected: collections.Counter[str] = collections.Counter()
        max_items = self.schema.limits.max_items_per_forward
        with watch("decode"):
            decoded = self.decoder.decode_batch(payloads, max_items)
        for index, refusal in decoded.refused:
            responses[index] = refusal.response()
            error = refusal.error
            rejected[error.reason if isinstance(error, BadRequest) else type(error).__name__] += 1
        parts = decoded.parts
        pruned: collections.Counter[str] = collections.Counter()
        if self.pruned_ids is not None:
            for part in parts:
                pruned.update(self.pruned_ids.count(part.inputs))
        forward_items = []
        for chunk in chunk_by_items([p.inputs for p in parts], max_items):
            forward_items.append(sum(parts[i].inputs.num_items for i in chunk))
            positions = [index for i in chunk for index in parts[i].positions]
            encoders = [encoder for i in chunk for encoder in parts[i].encoders]
            try:
                output, counts = self._forward([parts[i].inputs for i in chunk], watch)
            except ServingError as error:  # e.g. a dense host's shard is down: 503 naming it
                logger.debug("forward of %d requests answered %d: %s", len(positions), error.status, error.message)
                for index, encoder in zip(positions, encoders):
                    responses[index] = encoder.error(error)
                continue
            except Exception:  # the model failed on validated input: a bug, not the client's
                logger.exception("forward failed for a chunk of %d requests", len(positions))
                for index, encoder in zip(positions, encoders):
                    responses[index] = encoder.error(InternalError("model forward failed"))
                continue
            with watch("encode"):  # sigmoid once for the chunk, not once per request
                logits = split_outputs(output, counts)
                scores = split_outputs(torch.sigmoid(output), counts) if self._scores else [None] * len(counts)
                for index, encoder, request_logits, request_scores in zip(positions, encoders, logits, scores):
                    responses[index] = encoder.answer(request_logits, request_scores)
        stats = BatchStats(
            stage_ms=watch.ms,
            forward_items=forward_items,
            rejected=dict(rejected),
            hashed_ids=sum(p.hashed_ids for p in parts),
            pruned_ids=dict(pruned),
        )
        return HandledBatch(responses, stats)  # type: ignore[arg-type]  # every index answered

    def logits(self, requests: Sequence[RequestInputs]) -> list[torch.Tensor]:
        """One forward over all items of ``requests`` (each one request's inputs, or a part of
        several); logits [n_k] per request (an embedding shard's: embeddings [n_k, W])."""
        return split_outputs(*self._forward(requests, _Stopwatch()))

    def _forward(self, requests: Sequence[RequestInputs], watch: _Stopwatch) -> tuple[torch.Tensor, list[int]]:
        """The forward's output for the items of ``requests``: logits [N] (an embedding shard's
        embeddings [N, W]), and the items of each request, in order."""
        with watch("coalesce"):
            padded = list(requests)
            missing = self.schema.min_requests - sum(len(r.counts) for r in padded)
            if missing > 0:
                padded += [padding_request(requests[0], self.tags)] * missing
            batch = coalesce(padded, self.tags)
            padding_ids = any(isinstance(v, JaggedIds) and v.values.numel() == 0 for v in batch.values())
            if padding_ids:
                # A graph captured by torch.export asserts that a jagged input holds some id.
                padded.append(padding_request(requests[0], self.tags, with_ids=True))
                batch = coalesce(padded, self.tags)
        if self.threads_for is not None:
            threads = self.threads_for(sum(r.num_items for r in padded))
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        uncounted = self.unseen_ids.uncounted() if padding_ids and self.unseen_ids else contextlib.nullcontext()
        with watch("forward"), torch.inference_mode(), uncounted:  # the padding's id is not the client's
            output = self.model(batch).cpu()
        # scores: logits [N]; an embedding shard: each item's pooled embeddings as one row [N, W]
        output = output.reshape(-1) if self._scores else output.flatten(1)
        counts = [c for r in requests for c in r.counts]
        items = sum(counts)
        return (output if output.shape[0] == items else output[:items]), counts
