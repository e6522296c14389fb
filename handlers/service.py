"""The scoring service: a TorchServe batch of K request bodies -> K responses.

``handle`` is decode -> coalesce -> run -> split -> encode; each stage is a function of its own module.
It knows nothing about TorchServe (``handlers.torchserve_handler`` adapts it), so tests drive it
in-process with the same bodies the server receives.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence

import orjson
import torch
from torch import nn

from handlers.batching import (
    RequestInputs,
    chunk_by_items,
    coalesce,
    padding_request,
    split_outputs,
)
from handlers.decode import DecodedRequest, RequestDecoder
from handlers.errors import InternalError, ServingError
from handlers.export import Artifact, GraphModel, min_requests
from handlers.factory import DLRMFactory
from handlers.models import input_tags
from handlers.spec import ModelSpec
from handlers.split import SplitModel, SplitPlan

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Response:
    status: int
    body: bytes


class ScoringService:
    """Scores requests with one model; one response per request, in order.

    ``min_requests``: the fewest requests the model takes in one forward (a graph captured with
    TorchAO's int8 dynamic quantization takes 2); a smaller batch is padded with empty requests.
    """

    def __init__(
        self, spec: ModelSpec, model: nn.Module | GraphModel | SplitModel, min_requests: int = 1
    ) -> None:
        self.spec = spec
        self.model = model
        self.min_requests = min_requests
        self.decoder = RequestDecoder(spec)
        self.tags = input_tags(spec)
        self.device = torch.device(spec.sharding.device)
        # Items in each forward of the latest ``handle`` call, for the handler's metrics.
        self.last_forward_items: list[int] = []

    @classmethod
    def from_files(cls, spec_path: str | Path, weights_path: str | Path) -> "ScoringService":
        """The eager model: the factory's TorchRec modules on the memory-mapped weights."""
        spec = ModelSpec.from_yaml(spec_path)
        factory = DLRMFactory(spec)
        model = factory.inference_model(factory.load_weights(weights_path))
        return cls(spec, model)

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, artifact: Artifact, split: SplitPlan | None = None
    ) -> "ScoringService":
        """What an archive folder serves: ``spec.yaml`` plus the artifact's file(s); ``split`` says
        what the parts of a ``split`` artifact are."""
        model_dir = Path(model_dir)
        if artifact == Artifact.EAGER:
            return cls.from_files(model_dir / "spec.yaml", model_dir / artifact.file_name())
        spec = ModelSpec.from_yaml(model_dir / "spec.yaml")
        if artifact == Artifact.SPLIT:
            model: GraphModel | SplitModel = SplitModel.load(model_dir, spec, split or SplitPlan())
        else:
            model = GraphModel(model_dir / artifact.file_name(), artifact, input_tags(spec))
        return cls(spec, model, min_requests(spec))

    def handle(self, payloads: Sequence[Any]) -> list[Response]:
        responses: list[Response | None] = [None] * len(payloads)
        decoded: list[tuple[int, DecodedRequest]] = []
        for index, payload in enumerate(payloads):
            try:
                decoded.append((index, self.decoder.decode(payload)))
            except ServingError as e:
                responses[index] = _error_response(e)
        requests = [d.inputs for _, d in decoded]
        self.last_forward_items = []
        for chunk in chunk_by_items(requests, self.spec.limits.max_items_per_forward):
            self.last_forward_items.append(sum(requests[i].num_items for i in chunk))
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
        return responses  # type: ignore[return-value]  # every index was answered above

    def logits(self, requests: Sequence[RequestInputs]) -> list[torch.Tensor]:
        """One forward over all items of ``requests``; logits [n_k] per request."""
        padded = list(requests)
        if len(padded) < self.min_requests:
            padded += [padding_request(requests[0], self.tags)] * (self.min_requests - len(padded))
        batch = coalesce(padded, self.tags)
        if self.device.type != "cpu":
            batch = {name: value.to(self.device) for name, value in batch.items()}
        with torch.inference_mode():
            output = self.model(**batch).reshape(-1).cpu()
        counts = [r.num_items for r in requests]
        return split_outputs(output[: sum(counts)], counts)


def _scores_response(logits: torch.Tensor, return_logits: bool) -> Response:
    body: dict[str, list[float]] = {"scores": torch.sigmoid(logits).tolist()}
    if return_logits:
        body["logits"] = logits.tolist()
    return Response(200, orjson.dumps(body))


def _error_response(error: ServingError) -> Response:
    return Response(error.status, orjson.dumps(error.to_body()))
