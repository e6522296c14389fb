"""Production-like traffic from a spec, or replayed from a JSON-lines trace.

Ids follow a Zipf-like law per feature (a few hot ids, a long tail), scattered over the table by a
multiplicative hash so the hot rows are not all at the start; bag lengths are Poisson around a mean
(0 = the feature is missing); a request holds one item or a context with n candidates.

    traffic = TrafficModel(items_per_request=100).generate(spec, num_requests=500, seed=0)
    traffic.write_trace(Path("trace.jsonl"))          # one request body per line
    Traffic.read_trace(Path("trace.jsonl"))           # the same bodies back
    traffic.as_example_form(schema)                   # as TorchServe's DLRM example clients send them
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from typing import Any

import numpy as np
import orjson

from archive_tools.client import ScoringClient
from handlers.modeling.registry import input_schema
from handlers.runtime.inputs import InputSchema
from handlers.runtime.wire.messages import BinaryBody
from handlers.runtime.wire.v2_tensors import encode_request
from handlers.modeling.spec import ModelSpec

_GOLDEN = 2654435761  # Knuth's multiplicative hash constant: scatters hot ids over the table


@dataclasses.dataclass(frozen=True)
class TrafficModel:
    """``items_per_request``: candidates per request (1: one item), or with ``draw_items`` the most,
    each request drawing its count uniformly from 1..items_per_request. ``candidate_features``: for
    a DLRM, the sparse features that vary per candidate (the rest, and the dense features, are the
    shared user context repeated in each item); a context ranker sends its context once."""

    items_per_request: int = 1
    zipf_exponent: float = 1.1
    mean_bag: float = 1.0
    candidate_features: tuple[str, ...] = ()
    draw_items: bool = False

    def generate(self, spec: ModelSpec, num_requests: int, seed: int) -> "Traffic":
        rng = np.random.default_rng(seed)
        counts = (
            rng.integers(1, self.items_per_request + 1, size=num_requests).tolist()
            if self.draw_items
            else [self.items_per_request] * num_requests
        )
        context_width = input_schema(spec).context_features
        bodies = [orjson.dumps(self._request(spec, n, rng, context_width)) for n in counts]
        return Traffic(bodies=bodies, items=counts)

    def _request(
        self, spec: ModelSpec, n: int, rng: np.random.Generator, context_width: int
    ) -> dict:
        # A model without a context input sees a user's features repeated in each candidate.
        varying = set(spec.feature_names) if n == 1 or context_width else set(self.candidate_features)
        shared = {f: self._bag(rows, rng) for f, rows in zip(spec.feature_names, spec.feature_rows)}
        user_dense = self._dense(spec.dense_features, rng)
        items = []
        for _ in range(n):
            sparse = {
                f: self._bag(rows, rng) if f in varying else shared[f]
                for f, rows in zip(spec.feature_names, spec.feature_rows)
            }
            dense = self._dense(spec.dense_features, rng) if context_width else user_dense
            items.append({"dense": dense, "sparse": sparse})
        request: dict = {"items": items}
        if context_width:
            request["context"] = self._dense(context_width, rng)
        return request

    @staticmethod
    def _dense(width: int, rng: np.random.Generator) -> list[float]:
        return rng.normal(size=width).round(3).tolist()

    def _bag(self, rows: int, rng: np.random.Generator) -> list[int]:
        length = int(rng.poisson(self.mean_bag))
        ranks = rng.zipf(self.zipf_exponent, size=length) - 1
        return ((ranks * _GOLDEN) % rows).tolist()


@dataclasses.dataclass
class Traffic:
    """Encoded request bodies and their item counts, in send order (cycled by the load generator).
    ``header_lengths``: for KServe v2 binary bodies, each one's JSON header length (sent as
    ``Inference-Header-Content-Length``); None for JSON bodies."""

    bodies: list[bytes]
    items: list[int]
    header_lengths: list[int] | None = None

    def payload(self, index: int) -> Any:
        """Body ``index`` as the handler's service takes it."""
        if self.header_lengths is None:
            return self.bodies[index]
        return BinaryBody(self.bodies[index], self.header_lengths[index])

    def as_tensors(self, schema: InputSchema) -> "Traffic":
        """The same requests (items-form JSON bodies) as KServe v2 binary bodies."""
        client = ScoringClient(schema.model, schema, rest_url="http://127.0.0.1")
        bodies, lengths = [], []
        for body in self.bodies:
            request = orjson.loads(body)
            body, length = encode_request(
                client.tensors(request["items"], request.get("context"), request.get("context_sparse"))
            )
            bodies.append(body)
            lengths.append(length)
        return Traffic(bodies, list(self.items), lengths)

    def as_example_form(self, schema: InputSchema) -> "Traffic":
        """The same requests (items-form JSON bodies) in TorchRec's columnar form, as TorchServe's
        DLRM example clients send them: ``float_features`` flat (D floats per item), the bag
        lengths feature-major (every item's for feature 0, then feature 1, ...) and the ids in
        that order. A context model's context goes along as it was."""
        features = schema.feature_names
        bodies = []
        for body in self.bodies:
            request = orjson.loads(body)
            items = request.pop("items")
            bags = [[item["sparse"].get(f, []) for item in items] for f in features]
            bodies.append(orjson.dumps({
                "float_features": [x for item in items for x in item["dense"]],
                "id_list_features.lengths": [len(bag) for feature in bags for bag in feature],
                "id_list_features.values": [i for feature in bags for bag in feature for i in bag],
                **request,
            }))
        return Traffic(bodies, list(self.items))

    def write_trace(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(body + b"\n" for body in self.bodies))

    @classmethod
    def read_trace(cls, path: Path, dense_features: int | None = None) -> "Traffic":
        """The trace's bodies; ``dense_features``: the model's D, which counts the items of a
        columnar body whose ``float_features`` are flat (D numbers per item)."""
        bodies = [line for line in path.read_bytes().splitlines() if line.strip()]
        items = []
        for i, body in enumerate(bodies):
            request = orjson.loads(body)
            if "items" in request:
                items.append(len(request["items"]))
            elif "float_features" in request:
                dense = request["float_features"]
                if dense and not isinstance(dense[0], list):  # flat
                    if dense_features is None:
                        raise ValueError(f"{path}:{i + 1}: flat float_features: give the model's dense_features")
                    items.append(len(dense) // dense_features)
                else:
                    items.append(len(dense))
            else:
                raise ValueError(f"{path}:{i + 1}: neither 'items' nor 'float_features'")
        return cls(bodies=bodies, items=items)
