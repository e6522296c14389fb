"""The verification gate: the artifact, loaded fresh as the handler loads it, against the reference.

The reference is the trained float model (or, for ``--init quantized``, the model that was built).
On validation data (a file, ``archive_tools.validation_data``, or requests generated from the spec)
it reports the largest absolute and relative score differences and, where labels exist, AUC, log
loss and normalized entropy (NE) of both models. Past the bounds the archive is refused; the
report says which bound and by how much. With ``expected_auc`` (the training evaluation's AUC) the
served artifact is also held to it, as teams check before a model ships.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import orjson
import torch

from archive_tools.model_errors import describe_batch, raised_by_model
from archive_tools.validation_data import ValidationData, ValidationDataError
from handlers.modeling.registry import synthetic_request
from handlers.modeling.spec import ModelSpec
from handlers.runtime.batching import chunk_by_items, coalesce
from handlers.runtime.service import ScoringService
from handlers.runtime.wire.messages import Rejected


@dataclasses.dataclass(frozen=True)
class Bounds:
    max_abs_score_diff: float = 0.02
    max_rel_score_diff: float | None = None
    max_auc_drop: float = 0.001
    max_ne_increase: float = 0.002
    expected_auc: float | None = None  # the training evaluation's, held to within max_auc_drop


def generated_validation(
    spec: ModelSpec, reference: ScoringService, num_requests: int, items: int, seed: int,
    owned_ids: Mapping[str, torch.Tensor] | None = None,
) -> ValidationData:
    """Requests from the spec (a raw-id table's ids mostly among ``owned_ids``, per table), with clicks
    drawn from the reference's standardized logits (sigmoid of 2 z-scores). The reference then
    ranks them well (AUC about 0.8) even with untrained weights, whose raw scores all sit near
    0.5; a served model that ranks differently loses AUC and gains NE."""
    requests = [
        synthetic_request(spec, items, seed=seed + 1000 + k, max_bag=4, owned_ids=owned_ids)
        for k in range(num_requests)
    ]
    origins = [f"generated request {k}" for k in range(num_requests)]
    data = ValidationData(requests, None, "generated", origins)
    scored = _scores(reference, data, "verification (the float model labelling generated requests)")
    logits = torch.logit(torch.cat(scored).double(), eps=1e-12)
    z = (logits - logits.mean()) / logits.std().clamp_min(1e-12)
    generator = torch.Generator().manual_seed(seed)
    clicks = torch.bernoulli(torch.sigmoid(2 * z), generator=generator).int()
    labels = [part.tolist() for part in torch.split(clicks, items)]
    source = f"generated from the spec ({num_requests} x {items} items)"
    return ValidationData(requests, labels, source, origins)


@dataclasses.dataclass(frozen=True)
class Quality:
    """How well one model's scores rank and predict the labels."""

    auc: float
    log_loss: float
    ne: float


@dataclasses.dataclass(frozen=True)
class VerificationReport:
    source: str
    requests: int
    items: int
    max_abs_score_diff: float
    max_rel_score_diff: float
    reference: Quality | None
    served: Quality | None
    bounds: Bounds
    failures: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> bytes:
        return orjson.dumps(
            {**dataclasses.asdict(self), "passed": self.passed}, option=orjson.OPT_INDENT_2
        )

    def lines(self, against: str) -> list[str]:
        out = [
            f"verification on {self.source}: {self.requests} requests, {self.items} items",
            f"  max |score - {against} score| = {self.max_abs_score_diff:.2e} "
            f"(relative {self.max_rel_score_diff:.2e}), bound {self.bounds.max_abs_score_diff:g}",
        ]
        if self.served is not None and self.reference is not None:
            out.append(
                f"  AUC {self.served.auc:.5f} vs {self.reference.auc:.5f} ({against}); "
                f"log loss {self.served.log_loss:.5f} vs {self.reference.log_loss:.5f}; "
                f"NE {self.served.ne:.5f} vs {self.reference.ne:.5f}"
            )
            if self.bounds.expected_auc is not None:
                out.append(f"  training evaluation's AUC {self.bounds.expected_auc:.5f}")
        out.append("  passed" if self.passed else "  FAILED: " + "; ".join(self.failures))
        return out


def verify(
    served: ScoringService, reference: ScoringService, data: ValidationData, bounds: Bounds
) -> VerificationReport:
    served_scores = torch.cat(_scores(served, data, "verification (the served model)"))
    reference_scores = torch.cat(_scores(reference, data, "verification (the reference model)"))
    diff = (served_scores - reference_scores).abs()
    max_abs = float(diff.max())
    max_rel = float((diff / reference_scores.clamp_min(1e-12)).max())
    failures = []
    if max_abs > bounds.max_abs_score_diff:
        failures.append(f"max abs score diff {max_abs:.3e} > {bounds.max_abs_score_diff:g}")
    if bounds.max_rel_score_diff is not None and max_rel > bounds.max_rel_score_diff:
        failures.append(f"max rel score diff {max_rel:.3e} > {bounds.max_rel_score_diff:g}")
    reference_quality = served_quality = None
    if data.labels is not None:
        labels = torch.tensor([y for request in data.labels for y in request])
        reference_quality = quality(reference_scores, labels)
        served_quality = quality(served_scores, labels)
        if reference_quality.auc - served_quality.auc > bounds.max_auc_drop:
            drop = reference_quality.auc - served_quality.auc
            failures.append(f"AUC drop {drop:.2e} > {bounds.max_auc_drop:g}")
        if served_quality.ne - reference_quality.ne > bounds.max_ne_increase:
            rise = served_quality.ne - reference_quality.ne
            failures.append(f"NE increase {rise:.2e} > {bounds.max_ne_increase:g}")
        expected = bounds.expected_auc
        if expected is not None and expected - served_quality.auc > bounds.max_auc_drop:
            failures.append(
                f"AUC {served_quality.auc:.5f} is {expected - served_quality.auc:.2e} below the "
                f"training evaluation's {expected:g} (bound {bounds.max_auc_drop:g})"
            )
    return VerificationReport(
        source=data.source,
        requests=len(data.requests),
        items=int(served_scores.numel()),
        max_abs_score_diff=max_abs,
        max_rel_score_diff=max_rel,
        reference=reference_quality,
        served=served_quality,
        bounds=bounds,
        failures=tuple(failures),
    )


def quality(scores: torch.Tensor, labels: torch.Tensor) -> Quality:
    loss = log_loss(scores, labels)
    return Quality(auc(scores, labels), loss, loss / base_rate_log_loss(labels))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The chance that a click is scored above a non-click, ties one half (NaN if the labels
    all agree)."""
    once = torch.ones(1, len(labels), dtype=torch.float64)
    return float(weighted_auc(scores, labels.to(torch.float64), once)[0])


def weighted_auc(scores: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """float64 [draws]: the AUC of ``scores`` [rows] against 0/1 ``labels`` [rows] with the rows
    weighted by ``counts`` [draws, rows], each draw's (a bootstrap draw: how often each row was
    drawn). One pass over the rows sorted by score: the Mann-Whitney statistic, rows of equal score
    in one group (a click and a non-click that tie count one half). Written here, not imported from
    TorchMetrics: its import (1.2 s, matplotlib with it) cost every build more than its check."""
    order = torch.argsort(scores.to(torch.float64))
    _, group = torch.unique_consecutive(scores.to(torch.float64)[order], return_inverse=True)
    groups = int(group.max()) + 1 if len(group) else 0
    clicks = torch.zeros(len(counts), groups, dtype=torch.float64)
    others = torch.zeros_like(clicks)
    weights, y = counts[:, order], labels[order]
    clicks.index_add_(1, group, weights * y)
    others.index_add_(1, group, weights * (1 - y))
    below = torch.cumsum(others, dim=1) - others  # non-clicks scored below each group
    wins = (clicks * (below + 0.5 * others)).sum(dim=1)
    return wins / (clicks.sum(dim=1) * others.sum(dim=1))


def log_loss(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of the click probabilities ``scores`` (natural log)."""
    p = scores.double().clamp(1e-12, 1 - 1e-12)
    y = labels.double()
    return -(y * p.log() + (1 - y) * (1 - p).log()).mean().item()


def base_rate_log_loss(labels: torch.Tensor) -> float:
    """Log loss of always predicting the click rate: NE's denominator (NaN if all labels agree)."""
    rate = labels.double().mean().item()
    if rate in (0.0, 1.0):
        return math.nan
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def normalized_entropy(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Log loss of ``scores`` divided by the log loss of always predicting the base rate.

    1.0 is no better than the click rate alone; lower is better.
    """
    return log_loss(scores, labels) / base_rate_log_loss(labels)


def _scores(service: ScoringService, data: ValidationData, stage: str) -> list[torch.Tensor]:
    """Click probabilities per request, through the service's own decoder and coalescer; a
    request it refuses names its line, an error of the model's own names the batch
    (``model_errors``, ``stage``: what the build was doing)."""
    inputs = []
    for request, origin in zip(data.requests, data.origins):
        try:
            inputs.append(service.decoder.decode(request).inputs)
        except Rejected as refusal:
            raise ValidationDataError(f"{origin}: {refusal.error.message}") from None
    if data.labels is not None:
        for request, labels, origin in zip(inputs, data.labels, data.origins):
            if len(labels) != request.num_items:
                raise ValidationDataError(
                    f"{origin}: labels: one label per item: the request has {request.num_items} "
                    f"items, got {len(labels)} labels"
                )
    scores: list[torch.Tensor] = []
    for chunk in chunk_by_items(inputs, service.schema.limits.max_items_per_forward):
        requests = [inputs[i] for i in chunk]

        def shape() -> str:
            return describe_batch(coalesce(requests, service.tags), service.tags, len(requests))

        with raised_by_model(stage, shape):
            scores += [torch.sigmoid(logits) for logits in service.logits(requests)]
    return scores
