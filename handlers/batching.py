"""Batch tags and the coalescer: K decoded requests -> one forward -> K answers.

Each model input is tagged, once, with how it batches (``BatchKind``). The coalescer reads only the
tags; it knows nothing about DLRM. For K requests of n_1..n_K items (N = sum):

* ``ROWS``        [n_k, D] tensors          -> cat along dim 0                      -> [N, D]
* ``JAGGED``      per-feature bags of ids   -> one KeyedJaggedTensor, lengths laid out feature-major
  (optional per-id weights)                    ([F, N] flattened), values and weights permuted to match
* ``CONTEXT``     [1, D] once per request   -> [K, D], or with ``broadcast`` repeated to each of the
                                               request's items -> [N, D]
* ``ITEM_COUNTS`` made by the coalescer     -> int64 [K], n_1..n_K (lets a model broadcast context
                                               itself, after computing on it once per request)
* ``STATIC``      no batch dimension        -> the one tensor every request carries (must be equal)

Example::

    tags = (InputTag("dense_features", BatchKind.ROWS),
            InputTag("sparse_features", BatchKind.JAGGED, keys=("user_id", "item_id")))
    batch = coalesce(requests, tags)      # {"dense_features": [N, D], "sparse_features": KJT}
    outputs = split_outputs(model(**batch), [r.num_items for r in requests])
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterator, Sequence, Union

import torch

import fbgemm_gpu  # noqa: F401  registers torch.ops.fbgemm.permute_1D_sparse_data
from torchrec import KeyedJaggedTensor


class BatchKind(str, enum.Enum):
    ROWS = "rows"
    JAGGED = "jagged"
    CONTEXT = "context"
    ITEM_COUNTS = "item_counts"
    STATIC = "static"


@dataclasses.dataclass(frozen=True)
class InputTag:
    """How one named model input batches.

    ``keys``: the feature names of a ``JAGGED`` input. ``broadcast``: a ``CONTEXT`` input is repeated
    to its request's items by the coalescer (else the model gets one row per request).
    """

    name: str
    kind: BatchKind
    keys: tuple[str, ...] = ()
    broadcast: bool = False


@dataclasses.dataclass(frozen=True)
class JaggedIds:
    """Bags of ids of one request: F features x n items.

    ``lengths``: int64 [F, n], bag sizes feature-major; ``values``: int64 [lengths.sum()], the ids of
    feature 0 for items 0..n-1, then feature 1, and so on; ``weights``: float32 like ``values``, for
    a model with per-id weights, else None.
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None = None


RequestTensor = Union[torch.Tensor, JaggedIds]


@dataclasses.dataclass(frozen=True)
class RequestInputs:
    """One request's model inputs, keyed by input name, for ``num_items`` items."""

    num_items: int
    tensors: dict[str, RequestTensor]


BatchInput = Union[torch.Tensor, KeyedJaggedTensor]


def coalesce(requests: Sequence[RequestInputs], tags: Sequence[InputTag]) -> dict[str, BatchInput]:
    """Concatenates K requests into the inputs of one forward over all their items."""
    counts = torch.tensor([r.num_items for r in requests], dtype=torch.int64)
    batch: dict[str, BatchInput] = {}
    for tag in tags:
        if tag.kind == BatchKind.ITEM_COUNTS:
            batch[tag.name] = counts
            continue
        parts = [r.tensors[tag.name] for r in requests]
        if tag.kind == BatchKind.ROWS:
            batch[tag.name] = _cat_rows(parts)
        elif tag.kind == BatchKind.CONTEXT:
            rows = _cat_rows(parts)
            batch[tag.name] = (
                torch.repeat_interleave(rows, counts, dim=0, output_size=int(counts.sum()))
                if tag.broadcast
                else rows
            )
        elif tag.kind == BatchKind.STATIC:
            batch[tag.name] = _one_static(tag.name, parts)
        else:
            batch[tag.name] = _coalesce_jagged(parts, tag.keys)
    return batch


def _cat_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _one_static(name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """An input without a batch dimension can only be shared by requests that agree on it."""
    first = parts[0]
    for k, part in enumerate(parts[1:], start=1):
        if not torch.equal(part, first):
            raise ValueError(f"{name}: request {k} differs from request 0; a static input must match")
    return first


def _coalesce_jagged(parts: Sequence[JaggedIds], keys: tuple[str, ...]) -> KeyedJaggedTensor:
    weighted = parts[0].weights is not None
    if len(parts) == 1:
        lengths, values, weights = parts[0].lengths.reshape(-1), parts[0].values, parts[0].weights
    else:
        num_features = len(keys)
        lengths = torch.cat([p.lengths for p in parts], dim=1).reshape(-1)
        # values arrive request-major (k, f) in segments; TorchRec wants feature-major (f, k).
        segment_lengths = torch.stack([p.lengths.sum(dim=1) for p in parts]).reshape(-1)
        num_requests = len(parts)
        feature_major = (
            torch.arange(num_requests * num_features)
            .reshape(num_requests, num_features)
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
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys), values=values, lengths=lengths, weights=weights
    )


def padding_request(like: RequestInputs, tags: Sequence[InputTag]) -> RequestInputs:
    """One item of zero rows and empty bags, shaped like ``like``: fills a batch up to the size a
    graph was captured for. Its output is dropped."""
    tensors: dict[str, RequestTensor] = {}
    for tag in tags:
        if tag.kind == BatchKind.ITEM_COUNTS:
            continue
        part = like.tensors[tag.name]
        if isinstance(part, JaggedIds):
            tensors[tag.name] = JaggedIds(
                lengths=part.lengths.new_zeros(len(tag.keys), 1),
                values=part.values[:0],
                weights=None if part.weights is None else part.weights[:0],
            )
        elif tag.kind == BatchKind.STATIC:
            tensors[tag.name] = part
        else:  # ROWS and CONTEXT: [1, ...] per item / per request
            tensors[tag.name] = part.new_zeros(1, *part.shape[1:])
    return RequestInputs(num_items=1, tensors=tensors)


def split_outputs(output: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """[N, ...] -> one [n_k, ...] tensor per request, in request order."""
    return list(torch.split(output, list(counts), dim=0))


def chunk_by_items(
    requests: Sequence[RequestInputs], max_items: int
) -> Iterator[list[int]]:
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
