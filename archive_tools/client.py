"""A small client for a served model: items in, click probabilities out, sent as KServe v2 binary
tensors over TorchServe's REST or gRPC inference API.

    client = ScoringClient.from_archive("criteo", "model_store/criteo.mar",
                                        rest_url="http://127.0.0.1:8080", token=inference_key)
    client.score([{"dense": [...13 floats], "sparse": {"cat_0": [17], ...}}])   # float32 [n]
    client.rank(user, candidates)             # Ranking(order, scores): best candidate first

``token``: an inference key, or ``TokenKeys(Path("key_file.json"), management_url)`` on the
server's host, to have keys refreshed before they expire (``archive_tools.keys``).

Over gRPC (``grpc_target="127.0.0.1:7070"``) the same request bytes travel in TorchServe's
``PredictionsRequest.input`` map: ``body``, and the JSON header's length under
``Inference-Header-Content-Length``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import requests

from archive_tools.keys import TokenKeys
from handlers.runtime.archive import Archive
from handlers.runtime.inputs import InputSchema
from handlers.runtime.wire.v2_headers import HEADER_LENGTH
from handlers.runtime.wire.v2_tensors import decode_response, encode_request

Item = Mapping[str, Any]  # {"dense": [D floats], "sparse": {feature: [ids] or {"ids", "weights"}}}


@dataclasses.dataclass(frozen=True)
class Ranking:
    """Candidates by score, best first: ``order[0]`` is the best candidate's index."""

    order: np.ndarray
    scores: np.ndarray


class ScoringClient:
    """Scores items with the model ``model`` (registered under that name), whose inputs
    ``schema`` describes (the archive's ``inputs.json``). Give ``rest_url`` or ``grpc_target``."""

    def __init__(
        self,
        model: str,
        schema: InputSchema,
        *,
        rest_url: str | None = None,
        grpc_target: str | None = None,
        token: str | TokenKeys | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if (rest_url is None) == (grpc_target is None):
            raise ValueError("give exactly one of rest_url and grpc_target")
        self.model = model
        self.schema = schema
        self.timeout_s = timeout_s
        self._token = token
        self._session = requests.Session() if rest_url else None
        self._url = f"{rest_url.rstrip('/')}/v2/models/{model}/infer" if rest_url else None
        self._grpc = _GrpcSender(grpc_target) if grpc_target else None

    def _auth(self) -> dict[str, str]:
        if isinstance(self._token, TokenKeys):
            return self._token.header("inference")  # refreshed before it expires
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    @classmethod
    def from_archive(cls, model: str, archive: str | Path, **transport: Any) -> "ScoringClient":
        """The client for a model built as ``archive`` (its ``inputs.json`` says what it takes)."""
        with Archive.open(archive) as opened:
            return cls(model, opened.inputs, **transport)

    def score(
        self,
        items: Sequence[Item],
        context: Sequence[float] | None = None,
        context_sparse: Mapping[str, Sequence[int]] | None = None,
    ) -> np.ndarray:
        """Click probabilities of ``items``, in order; ``context``: the request's context row, for
        a model that takes one; ``context_sparse``: its per-request ids (e.g. ``{"history": [...]}``)."""
        outputs = self._send(self.tensors(items, context, context_sparse))
        return outputs["scores"]

    def rank(
        self, context: Any, candidates: Sequence[Item], context_sparse: Mapping[str, Sequence[int]] | None = None
    ) -> Ranking:
        """Candidates ordered by score for one context: the context row of a model that takes one,
        or else an item whose dense row and features each candidate shares where it gives none;
        ``context_sparse``: the request's per-request ids, for a model that takes them."""
        if self.schema.context is not None or self.schema.context_jagged is not None:
            scores = self.score(candidates, context if self.schema.context is not None else None, context_sparse)
        else:
            shared_sparse = context.get("sparse", {})
            merged = [
                {
                    "dense": candidate.get("dense", context.get("dense")),
                    "sparse": {**shared_sparse, **candidate.get("sparse", {})},
                }
                for candidate in candidates
            ]
            scores = self.score(merged)
        return Ranking(order=np.argsort(-scores, kind="stable"), scores=scores)

    def tensors(
        self,
        items: Sequence[Item],
        context: Sequence[float] | None = None,
        context_sparse: Mapping[str, Sequence[int]] | None = None,
    ) -> dict[str, np.ndarray]:
        """The model's inputs for ``items`` as named arrays, laid out as its batch tags say."""
        schema = self.schema
        features = schema.feature_names
        dense = np.asarray([item["dense"] for item in items], dtype=np.float32).reshape(
            len(items), schema.dense_features
        )
        bags = [[_ids(item.get("sparse", {}).get(f, [])) for item in items] for f in features]
        lengths = np.asarray([[len(ids) for ids, _ in row] for row in bags], dtype=np.int64)
        values = np.asarray([i for row in bags for ids, _ in row for i in ids], dtype=np.int64)
        jagged = schema.jagged.name
        arrays = {
            schema.rows.name: dense,
            f"{jagged}.lengths": lengths.reshape(len(features), len(items)),
            f"{jagged}.values": values,
        }
        if schema.weighted_ids:
            arrays[f"{jagged}.weights"] = np.asarray(
                [w for row in bags for _, weights in row for w in weights], dtype=np.float32
            )
        if schema.context is not None:
            if context is None:
                raise ValueError(f"this model takes a context row of {schema.context_features} numbers")
            arrays[schema.context.name] = np.asarray([context], dtype=np.float32)
        given = dict(context_sparse or {})
        unknown = sorted(set(given) - {f.name for f in schema.context_sparse})
        if unknown:
            takes = ", ".join(f.name for f in schema.context_sparse) or "none"
            raise ValueError(f"context_sparse: {unknown} are not this model's per-request features ({takes})")
        if schema.context_jagged is not None:  # per-request ids: lengths [F', 1], then the values
            sequences = [list(given.get(f.name, [])) for f in schema.context_sparse]
            name = schema.context_jagged.name
            arrays[f"{name}.lengths"] = np.asarray([[len(s)] for s in sequences], dtype=np.int64)
            arrays[f"{name}.values"] = np.asarray([i for s in sequences for i in s], dtype=np.int64)
        return arrays

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
        if self._grpc is not None:
            self._grpc.close()

    def __enter__(self) -> "ScoringClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        body, json_length = encode_request(arrays, outputs=("scores",))
        if self._grpc is not None:
            return decode_response(self._grpc.predict(self.model, body, json_length, self._auth(), self.timeout_s))
        headers = {HEADER_LENGTH: str(json_length), "Content-Type": "application/octet-stream"}
        for attempt in range(2):
            auth = self._auth()
            response = self._session.post(  # type: ignore[union-attr]
                self._url, data=body, headers={**headers, **auth}, timeout=self.timeout_s
            )
            if attempt == 0 and isinstance(self._token, TokenKeys) and TokenKeys.rejected(response):
                self._token.recover("inference", auth.get("Authorization", " ").split(" ")[-1])
                continue  # another client refreshed the key: once more with the new one
            break
        length = response.headers.get(HEADER_LENGTH)
        return decode_response(response.content, int(length) if length is not None else len(response.content))


class _GrpcSender:
    def __init__(self, target: str) -> None:
        import grpc

        from handlers.runtime.remote.grpc_stubs import inference_stub, messages

        self._channel = grpc.insecure_channel(target)
        self._stub = inference_stub(self._channel)
        self._messages = messages()

    def predict(self, model: str, body: bytes, json_length: int, auth: dict[str, str], timeout_s: float) -> bytes:
        request = self._messages.PredictionsRequest(
            model_name=model, input={"body": body, HEADER_LENGTH: str(json_length).encode()}
        )
        metadata = [(k.lower(), v) for k, v in auth.items()]
        return self._stub.Predictions(request, metadata=metadata, timeout=timeout_s).prediction

    def close(self) -> None:
        self._channel.close()


def _ids(bag: Any) -> tuple[list[int], list[float]]:
    """A bag as (ids, weights): a list of ids weighs 1 each."""
    if isinstance(bag, Mapping):
        return list(bag["ids"]), list(bag["weights"])
    return list(bag), [1.0] * len(bag)
