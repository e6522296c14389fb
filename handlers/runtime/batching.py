"""The coalescer: K decoded requests -> the inputs of one forward -> K answers.

It reads only the inputs' batch tags (``handlers.runtime.inputs``) and knows nothing about the
model. The batch it makes is what every artifact takes: plain tensors, with each jagged input as
``JaggedIds`` (lengths [F, N] feature-major, values and weights permuted to match by FBGEMM).

Example::

    batch = coalesce(requests, schema.tags)   # {"dense_features": [N, D], "sparse_features": JaggedIds}
    outputs = split_outputs(model(batch), [c for r in requests for c in r.counts])
"""

from __future__ import annotations

from typing import Iterator, Sequence, Union

import torch

from handlers.runtime import fbgemm_ops  # noqa: F401  torch.ops.fbgemm.permute_1D_sparse_data
from handlers.runtime.inputs import BatchKind, InputSchema, InputTag, JaggedIds, RequestInputs, RequestTensor

BatchInput = Union[torch.Tensor, JaggedIds]
Batch = dict[str, BatchInput]


def coalesce(requests: Sequence[RequestInputs], tags: Sequence[InputTag]) -> Batch:
    """Concatenates K requests (or parts of several, ``RequestInputs.item_counts``) into the
    inputs of one forward over all their items."""
    batch: Batch = {}
    for tag in tags:
        if tag.kind == BatchKind.ITEM_COUNTS:
            batch[tag.name] = torch.tensor([c for r in requests for c in r.counts], dtype=torch.int64)
            continue
        parts = [r.tensors[tag.name] for r in requests]
        if tag.kind in (BatchKind.ROWS, BatchKind.CONTEXT):
            batch[tag.name] = _cat_rows(parts)
        else:
            batch[tag.name] = _coalesce_jagged(parts)
    return batch


def plain_arguments(batch: Batch, tags: Sequence[InputTag]) -> tuple[torch.Tensor, ...]:
    """The batch as a graph's positional tensors, in tag order; a jagged input gives
    ``values [V], lengths [F, N]`` and, when weighted, ``weights [V]``."""
    arguments: list[torch.Tensor] = []
    for tag in tags:
        value = batch[tag.name]
        if isinstance(value, JaggedIds):
            arguments += [value.values, value.lengths]
            if value.weights is not None:
                arguments.append(value.weights)
        else:
            arguments.append(value)
    return tuple(arguments)


def _cat_rows(parts: Sequence[RequestTensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # type: ignore[arg-type]


def _coalesce_jagged(parts: Sequence[JaggedIds]) -> JaggedIds:
    if len(parts) == 1:
        return parts[0]
    num_features = parts[0].lengths.shape[0]
    weighted = parts[0].weights is not None
    lengths = torch.cat([p.lengths for p in parts], dim=1)
    # values arrive request-major (k, f) in segments; the batch wants feature-major (f, k).
    # Segment (k, f) holds part k's ids of feature f: differences of running sums at part ends.
    ends = torch.tensor([0] + [p.lengths.shape[1] for p in parts]).cumsum(0)
    running = torch.cat([lengths.new_zeros(num_features, 1), lengths.cumsum(dim=1)], dim=1)[:, ends]
    segment_lengths = running.diff(dim=1).t().reshape(-1)
    feature_major = (
        torch.arange(len(parts) * num_features)
        .reshape(len(parts), num_features)
        .t()
        .reshape(-1)
        .to(torch.int32)
    )
    _, values, weights = torch.ops.fbgemm.permute_1D_sparse_data(
        feature_major,
        segment_lengths,
        torch.cat([p.values for p in parts]),
        torch.cat([p.weights for p in parts]) if weighted else None,  # type: ignore[misc]
    )
    return JaggedIds(lengths=lengths, values=values, weights=weights)


def padding_request(
    like: RequestInputs, schema: InputSchema, with_ids: bool = False
) -> RequestInputs:
    """One item of zero rows shaped like ``like``, each bag holding the fewest ids its feature
    takes (``Feature.min_ids``, id 0): fills a batch up to the size a graph was captured for. Its
    output is dropped. ``with_ids``: the first bag of each jagged input holds at least one id (a
    batch of no ids at all is one a captured graph refuses)."""
    tensors: dict[str, RequestTensor] = {}
    for tag in schema.tags:
        if tag.kind == BatchKind.ITEM_COUNTS:
            continue
        part = like.tensors[tag.name]
        if isinstance(part, JaggedIds):
            features = schema.context_sparse if tag.kind == BatchKind.CONTEXT_JAGGED else schema.features
            lengths = torch.tensor([[f.min_ids] for f in features], dtype=part.lengths.dtype)
            if with_ids:
                lengths[0, 0] = max(int(lengths[0, 0]), 1)
            count = int(lengths.sum())
            tensors[tag.name] = JaggedIds(
                lengths=lengths,
                values=part.values.new_zeros(count),
                weights=None if part.weights is None else part.weights.new_ones(count),
            )
        else:  # ROWS and CONTEXT: [1, ...] per item / per request
            tensors[tag.name] = part.new_zeros(1, *part.shape[1:])
    return RequestInputs(num_items=1, tensors=tensors)


def split_outputs(output: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """[N, ...] -> one [n_k, ...] tensor per request, in request order."""
    if len(counts) == 1:  # one request: its output whole (a split costs more than the encoding)
        return [output]
    return list(torch.split(output, list(counts), dim=0))


def chunk_by_items(requests: Sequence[RequestInputs], max_items: int) -> Iterator[list[int]]:
    """Groups request indices, in order, so that no group exceeds ``max_items`` items.

    Each request must itself fit (the decoder caps a request below the forward cap).
    """
    chunk: list[int] = []
    items = 0
    for i, request in enumerate(requests):
        if chunk and items + request.num_items > max_items:
            yield chunk
            chunk, items = [], 0
        chunk.append(i)
        items += request.num_items
    if chunk:
        yield chunk
