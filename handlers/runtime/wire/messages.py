"""What the wire decoders produce: a request's rows and tensors, and how to answer it. Each wire
form answers in its own shape (the project's JSON, TorchServe's DLRM example, the KServe v2
protocol), for scores and for errors alike.

    decoded = decoder.decode(body)             # DecodedRequest, or raises Rejected
    response = decoded.encoder.answer(logits)  # Response(200, b'{"scores": [...]}')
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping, NamedTuple, Protocol

import numpy as np
import orjson
import torch

from handlers.runtime.errors import ServingError
from handlers.runtime.inputs import JaggedIds, RequestInputs
from handlers.runtime.quiet import quieter

JSON = "application/json"


class Response(NamedTuple):
    """One request's answer (a named tuple: one is made per request, and it is cheap)."""

    status: int
    body: bytes
    content_type: str = JSON
    headers: Mapping[str, str] = MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class BinaryBody:
    """A request body of a JSON header (its first ``json_length`` bytes) followed by binary
    tensors: the KServe v2 binary extension."""

    data: bytes | bytearray
    json_length: int


class Encoder(Protocol):
    def answer(self, output: torch.Tensor, scores: torch.Tensor | None = None) -> Response:
        """The answer for one request's output: logits [n] (with their sigmoid, ``scores``, where
        the caller has it), or an embedding shard's rows [n, W]."""

    def error(self, error: ServingError) -> Response:
        """The answer when the request fails."""


@dataclasses.dataclass(frozen=True)
class JsonEncoder:
    """``{"scores": [...]}`` (and ``"logits"`` when asked); ``default`` adds TorchServe's DLRM
    example's ``"default": [logits]``, for its clients. Errors: ``{"code", "type", "message",
    "field"}``."""

    return_logits: bool = False
    default: bool = False

    def answer(self, logits: torch.Tensor, scores: torch.Tensor | None = None) -> Response:
        body: dict[str, list[float]] = {"scores": (torch.sigmoid(logits) if scores is None else scores).tolist()}
        if self.return_logits or self.default:
            values = logits.tolist()
            if self.return_logits:
                body["logits"] = values
            if self.default:
                body["default"] = values
        return Response(200, orjson.dumps(body))

    def error(self, error: ServingError) -> Response:
        return Response(error.status, orjson.dumps(error.to_body()))


@dataclasses.dataclass(frozen=True)
class DecodedRows:
    """A request's items: dense rows [n, D], their bags of ids, and how many ids were hashed."""

    dense: torch.Tensor
    ids: JaggedIds
    hashed_ids: int

    @classmethod
    def from_arrays(
        cls,
        dense: np.ndarray,
        lengths: np.ndarray,
        ids: np.ndarray,
        weights: np.ndarray | None,
        hashed_ids: int,
    ) -> "DecodedRows":
        jagged = JaggedIds(
            lengths=as_tensor(lengths),
            values=as_tensor(ids),
            weights=None if weights is None else as_tensor(weights),
        )
        return cls(as_tensor(dense), jagged, hashed_ids)


@dataclasses.dataclass(frozen=True)
class DecodedRequest:
    """One request's inputs, how to answer it, and how many of its ids the out-of-range policy
    hashed into their tables."""

    inputs: RequestInputs
    encoder: Encoder
    hashed_ids: int = 0


@dataclasses.dataclass(frozen=True)
class DecodedPart:
    """Requests decoded together: their indices in the TorchServe batch, the inputs of all their
    items (``inputs.counts``: each one's), how to answer each, and the ids the policy hashed."""

    positions: list[int]
    inputs: RequestInputs
    encoders: list[Encoder]
    hashed_ids: int = 0


@dataclasses.dataclass
class DecodedBatch:
    """A TorchServe batch decoded: parts in request order, and the requests refused (by index)."""

    parts: list[DecodedPart] = dataclasses.field(default_factory=list)
    refused: list[tuple[int, "Rejected"]] = dataclasses.field(default_factory=list)


class Rejected(Exception):
    """A request refused while decoding, with the answer in its wire form."""

    def __init__(self, error: ServingError, encoder: Encoder) -> None:
        super().__init__(error.message)
        self.error = error
        self.encoder = encoder

    def response(self) -> Response:
        return self.encoder.error(self.error)


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """The array as a tensor sharing its memory. Binary request tensors are views of the request's
    (read-only) bytes, which torch warns about; nothing downstream writes into a request's inputs."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with quieter(warning_messages=("The given NumPy array is not writable",)):
        return torch.from_numpy(array)
