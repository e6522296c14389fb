"""Answers in the KServe v2 / Open Inference Protocol form (``kserve_v2`` reads the requests):
scores, logits or an embedding shard's embeddings as FP32 tensors, in JSON or as binary tensors
after the JSON header."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import orjson
import torch

from handlers.runtime.errors import ServingError
from handlers.runtime.wire.messages import Response
from handlers.runtime.wire.v2_headers import BINARY, HEADER_LENGTH

EMBEDDINGS = "embeddings"  # an embedding shard's only output


@dataclasses.dataclass(frozen=True)
class V2Encoder:
    """Answers in the v2 form: each requested output an FP32 tensor ([n] scores or logits, or an
    embedding shard's [n, W]), as JSON data or, for those in ``binary``, as bytes after the JSON
    header. ``bags``: an embedding shard answers each feature's first bags_f items only, its
    features ``widths`` wide (the request's ``bags`` input)."""

    model_name: str
    request_id: str | None = None
    outputs: tuple[str, ...] = ("scores",)
    binary: frozenset[str] = frozenset()
    bags: tuple[int, ...] | None = None
    widths: tuple[int, ...] = ()
    model_version: str | None = None  # the registered version, where known (the OIP gRPC answer needs it)

    def answer(self, output: torch.Tensor, scores: torch.Tensor | None = None) -> Response:
        if self.outputs == (EMBEDDINGS,):
            if self.bags is not None:  # [n, W] -> each feature's [bags_f, D_f], flat
                starts = itertools.accumulate(self.widths, initial=0)
                output = torch.cat([
                    output[:bags, start : start + width].reshape(-1)
                    for bags, start, width in zip(self.bags, starts, self.widths)
                ])
            values = {EMBEDDINGS: output}
        else:
            values = {"scores": torch.sigmoid(output) if scores is None else scores, "logits": output}
        header: dict[str, Any] = {"model_name": self.model_name}
        if self.model_version is not None:
            header["model_version"] = self.model_version
        if self.request_id is not None:
            header["id"] = self.request_id
        tensors, blobs = [], []
        for name in self.outputs:
            value = values[name]
            tensor: dict[str, Any] = {"name": name, "datatype": "FP32", "shape": list(value.shape)}
            if name in self.binary:
                blob = value.numpy().astype("<f4", copy=False).tobytes()
                tensor["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                tensor["data"] = value.reshape(-1).tolist()
            tensors.append(tensor)
        header["outputs"] = tensors
        body = orjson.dumps(header)
        if not blobs:
            return Response(200, body)
        return Response(200, body + b"".join(blobs), BINARY, {HEADER_LENGTH: str(len(body))})

    def error(self, error: ServingError) -> Response:
        return Response(error.status, orjson.dumps({"error": error.message}))
