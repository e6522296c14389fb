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
import re
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from handlers.runtime.artifacts import Runner
from handlers.runtime.batching import chunk_by_items, coalesce, padding_request, split_outputs
from handlers.runtime.errors import BadRequest, InternalError, ModelRefused, ServingError
from handlers.runtime.inputs import BatchKind, Feature, InputSchema, InputTag, JaggedIds, Output, RequestInputs
from handlers.runtime.pruned_ids import PrunedIdCounter
from handlers.runtime.unseen_ids import UnseenIdCounter
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.messages import DecodedRequest, Response

logger = logging.getLogger(__name__)

STAGES = ("decode", "coalesce", "forward", "encode")


@dataclasses.dataclass(frozen=True)
class BatchStats:
    """One batch: milliseconds spent in each of ``STAGES``, the items of each forward, the
    requests refused by ``BadRequest`` reason, the ids the out-of-range policy hashed, and per
    pruned table the ids that looked up a zero row; ``split_forwards``: the forwards that raised
    and were split to find the requests that fail alone. (A raw-id model counts its unseen ids in the
    graph: ``ScoringService.unseen_ids``.)"""

    stage_ms: dict[str, float]
    forward_items: list[int]
    rejected: dict[str, int]
    hashed_ids: int
    pruned_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    split_forwards: int = 0


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


class _BatchInProgress:
    """What ``ScoringService.handle`` gathers over one batch: an answer per request, and its stats."""

    def __init__(self, payloads: Sequence[Any]) -> None:
        self.watch = _Stopwatch()
        self.responses: list[Response | None] = [None] * len(payloads)
        self.rejected: collections.Counter[str] = collections.Counter()
        self.forward_items: list[int] = []
        self.split_forwards = 0

    def answer(self, index: int, response: Response, error: ServingError) -> None:
        """Request ``index`` failed with ``error``: a 4xx is counted by its reason."""
        self.responses[index] = response
        if error.status < 500:
            self.rejected[error.reason if isinstance(error, BadRequest) else type(error).__name__] += 1


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
        self._raw_features = {  # each jagged input's raw-id features, as a mask over its keys
            tag.name: mask
            for tag in schema.tags
            if tag.kind in (BatchKind.JAGGED, BatchKind.CONTEXT_JAGGED)
            and (mask := torch.tensor([f.raw_id_table is not None for f in _features_of(schema, tag)])).any()
        }

    def handle(self, payloads: Sequence[Any]) -> HandledBatch:
        batch = _BatchInProgress(payloads)
        max_items = self.schema.limits.max_items_per_forward
        with batch.watch("decode"):
            decoded = self.decoder.decode_batch(payloads, max_items)
        for index, refusal in decoded.refused:
            batch.answer(index, refusal.response(), refusal.error)
        parts = decoded.parts
        pruned: collections.Counter[str] = collections.Counter()
        if self.pruned_ids is not None:
            for part in parts:
                pruned.update(self.pruned_ids.count(part.inputs))
        for chunk in chunk_by_items([p.inputs for p in parts], max_items):
            positions = [index for i in chunk for index in parts[i].positions]
            encoders = [encoder for i in chunk for encoder in parts[i].encoders]
            if self._score([parts[i].inputs for i in chunk], positions, encoders, batch):
                # the forward raised: find the requests that fail alone, and score the others
                batch.split_forwards += 1
                failed: list[tuple[int, Any, Exception]] = []
                self._score_apart([(index, self.decoder.decode(payloads[index])) for index in positions], batch, failed)
                others_scored = len(failed) < len(positions)
                for index, encoder, error in failed:
                    refusal = _model_error(error, others_scored)
                    batch.answer(index, encoder.error(refusal), refusal)
        stats = BatchStats(
            stage_ms=batch.watch.ms,
            forward_items=batch.forward_items,
            rejected=dict(batch.rejected),
            hashed_ids=sum(p.hashed_ids for p in parts),
            pruned_ids=dict(pruned),
            split_forwards=batch.split_forwards,
        )
        return HandledBatch(batch.responses, stats)  # type: ignore[arg-type]  # every index answered

    def _score(
        self,
        requests: Sequence[RequestInputs],
        positions: list[int],
        encoders: list[Any],
        batch: "_BatchInProgress",
        failed: list[tuple[int, Any, Exception]] | None = None,
    ) -> bool:
        """One forward over ``requests``, answering each at its position in ``batch``; True when
        the model raised on more than one request (none answered: the caller scores them apart).
        ``failed``: where a request that fails alone goes, unanswered (a split's: its answer
        depends on whether its neighbours were scored), else it is answered now."""
        batch.forward_items.append(sum(r.num_items for r in requests))
        try:
            output, counts = self._forward(requests, batch.watch)
        except ServingError as error:  # e.g. a dense host's shard is down: 503 naming it
            logger.debug("forward of %d requests answered %d: %s", len(positions), error.status, error.message)
            for index, encoder in zip(positions, encoders):
                batch.answer(index, encoder.error(error), error)
            return False
        except Exception as error:
            if len(positions) > 1:
                return True
            if failed is not None:
                failed.append((positions[0], encoders[0], error))
                return False
            refusal = _model_error(error, others_scored=False)
            batch.answer(positions[0], encoders[0].error(refusal), refusal)
            return False
        with batch.watch("encode"):  # sigmoid once for the chunk, not once per request
            logits = split_outputs(output, counts)
            scores = split_outputs(torch.sigmoid(output), counts) if self._scores else [None] * len(counts)
            for index, encoder, request_logits, request_scores in zip(positions, encoders, logits, scores):
                batch.responses[index] = encoder.answer(request_logits, request_scores)
        return False

    def _score_apart(
        self, requests: list[tuple[int, DecodedRequest]], batch: "_BatchInProgress", failed: list
    ) -> None:
        """Requests whose forward together raised (each decoded alone), scored in halves, then
        alone where a half raises too: the requests that fail alone go to ``failed``."""
        middle = len(requests) // 2
        for half in (requests[:middle], requests[middle:]):
            positions = [index for index, _ in half]
            encoders = [request.encoder for _, request in half]
            if self._score([request.inputs for _, request in half], positions, encoders, batch, failed):
                self._score_apart(half, batch, failed)

    def logits(self, requests: Sequence[RequestInputs]) -> list[torch.Tensor]:
        """One forward over all items of ``requests`` (each one request's inputs, or a part of
        several); logits [n_k] per request (an embedding shard's: embeddings [n_k, W])."""
        return split_outputs(*self._forward(requests, _Stopwatch()))

    def _counting(self, requests: Sequence[RequestInputs], padded: Sequence[RequestInputs]) -> Any:
        """How a forward's raw ids are counted: none of a forward that raises (its requests are
        scored again), and none of one whose only raw ids are its padding's. A padding item
        beside the clients' raw ids is counted with them: its feature's ``min_ids`` of id 0."""
        if self.unseen_ids is None:
            return contextlib.nullcontext()
        padding_only = len(padded) > len(requests) and not any(self._raw_ids_in(r) for r in requests)
        return self.unseen_ids.uncounted(unless_it_raises=not padding_only)

    def _raw_ids_in(self, request: RequestInputs) -> bool:
        return any(
            bool(request.tensors[name].lengths[mask].any())  # type: ignore[union-attr]
            for name, mask in self._raw_features.items()
        )

    def _forward(self, requests: Sequence[RequestInputs], watch: _Stopwatch) -> tuple[torch.Tensor, list[int]]:
        """The forward's output for the items of ``requests``: logits [N] (an embedding shard's
        embeddings [N, W]), and the items of each request, in order."""
        with watch("coalesce"):
            padded = list(requests)
            missing = self.schema.min_requests - sum(len(r.counts) for r in padded)
            if missing > 0:
                padded += [padding_request(requests[0], self.schema)] * missing
            batch = coalesce(padded, self.tags)
            if any(isinstance(v, JaggedIds) and v.values.numel() == 0 for v in batch.values()):
                # A graph captured by torch.export asserts that a jagged input holds some id.
                padded.append(padding_request(requests[0], self.schema, with_ids=True))
                batch = coalesce(padded, self.tags)
        if self.threads_for is not None:
            threads = self.threads_for(sum(r.num_items for r in padded))
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        with watch("forward"), torch.inference_mode(), self._counting(requests, padded):
            output = self.model(batch).cpu()
        # scores: logits [N]; an embedding shard: each item's pooled embeddings as one row [N, W]
        output = output.reshape(-1) if self._scores else output.flatten(1)
        counts = [c for r in requests for c in r.counts]
        items = sum(counts)
        return (output if output.shape[0] == items else output[:items]), counts


def _features_of(schema: InputSchema, tag: InputTag) -> tuple[Feature, ...]:
    return schema.context_sparse if tag.kind == BatchKind.CONTEXT_JAGGED else schema.features


# What a model raises on the shape or values of one request (a bag of two ids where it takes one):
# the request is to blame, not the server.
_INPUT_ERRORS = (AssertionError, IndexError, ValueError)
_INPUT_ERROR_WORDS = re.compile(r"shape|size|dimension|out of (bounds|range)|index|assert", re.IGNORECASE)


def _model_error(error: Exception, others_scored: bool) -> ServingError:
    """A forward's exception on one request alone, as its answer: a 4xx naming the model's
    error where the input is to blame (the requests batched beside it were scored, or the error
    is one of shapes or values), else a 500 (logged with its traceback). A compiled graph's error
    says little (AOTInductor's names its runner's line), so its neighbours are the evidence."""
    if others_scored or isinstance(error, _INPUT_ERRORS) or (
        isinstance(error, RuntimeError) and _INPUT_ERROR_WORDS.search(str(error))
    ):
        logger.debug("the model refused a request: %s: %s", type(error).__name__, error)
        return ModelRefused(error)
    logger.error("forward failed for one request", exc_info=error)
    return InternalError("model forward failed")
