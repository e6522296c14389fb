"""The verification gate: the artifact, loaded fresh as the handler loads it, against the reference.

The reference is the trained float model (or, for ``--init quantized``, the model that was built).
On validation data (a JSON-lines file of requests with optional labels, or requests generated from
the spec) it reports the largest absolute and relative score differences and, where labels exist,
AUC and normalized entropy (NE) of both models and their deltas. Past the bounds the archive is
refused; the report says which bound and by how much.

A validation file holds one request per line, either a bare request body or
``{"request": {...}, "labels": [0, 1, ...]}`` with one 0/1 label per item.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import orjson
import torch
from torchmetrics.functional.classification import binary_auroc

from handlers.modeling.registry import synthetic_request
from handlers.modeling.spec import ModelSpec
from handlers.runtime.batching import chunk_by_items
from handlers.runtime.service import ScoringService


class ValidationDataError(ValueError):
    """A validation file that cannot be read; the message names the file, line and field."""


@dataclasses.dataclass(frozen=True)
class Bounds:
    max_abs_score_diff: float = 0.02
    max_rel_score_diff: float | None = None
    max_auc_drop: float = 0.001
    max_ne_increase: float = 0.002


@dataclasses.dataclass(frozen=True)
class ValidationData:
    """Request bodies, and per request one 0/1 label per item where labels exist."""

    requests: list[dict]
    labels: list[list[int]] | None
    source: str

    @classmethod
    def from_jsonl(cls, path: Path) -> "ValidationData":
        requests, labels = [], []
        for number, line in enumerate(path.read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise ValidationDataError(f"{path}:{number}: not JSON: {e}") from None
            if "request" in row:
                requests.append(row["request"])
                labels.append(row.get("labels"))
            else:
                requests.append(row)
                labels.append(None)
            if labels[-1] is not None and len(labels[-1]) != _item_count(requests[-1]):
                raise ValidationDataError(f"{path}:{number}: labels must hold one 0/1 label per item")
        if not requests:
            raise ValidationDataError(f"{path}: no requests")
        labelled = [lab for lab in labels if lab is not None]
        if labelled and len(labelled) != len(labels):
            raise ValidationDataError(f"{path}: either every request has labels or none has")
        return cls(requests, labels if labelled else None, f"file {path}")

    @classmethod
    def generated(
        cls, spec: ModelSpec, reference: ScoringService, num_requests: int, items: int, seed: int
    ) -> "ValidationData":
        """Requests from the spec, with clicks drawn from the reference's standardized logits
        (sigmoid of 2 z-scores). The reference then ranks them well (AUC about 0.8) even with
        untrained weights, whose raw scores all sit near 0.5; a served model that ranks
        differently loses AUC and gains NE."""
        requests = [
            synthetic_request(spec, items, seed=seed + 1000 + k, max_bag=4) for k in range(num_requests)
        ]
        logits = torch.logit(torch.cat(_scores(reference, requests)).double(), eps=1e-12)
        z = (logits - logits.mean()) / logits.std().clamp_min(1e-12)
        generator = torch.Generator().manual_seed(seed)
        clicks = torch.bernoulli(torch.sigmoid(2 * z), generator=generator).int()
        labels = [part.tolist() for part in torch.split(clicks, items)]
        return cls(requests, labels, f"generated from the spec ({num_requests} x {items} items)")


@dataclasses.dataclass(frozen=True)
class VerificationReport:
    source: str
    requests: int
    items: int
    max_abs_score_diff: float
    max_rel_score_diff: float
    auc_reference: float | None
    auc_served: float | None
    ne_reference: float | None
    ne_served: float | None
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
        if self.auc_reference is not None:
            out.append(
                f"  AUC {self.auc_served:.5f} vs {self.auc_reference:.5f} ({against}); "
                f"NE {self.ne_served:.5f} vs {self.ne_reference:.5f}"
            )
        out.append("  passed" if self.passed else "  FAILED: " + "; ".join(self.failures))
        return out


def verify(
    served: ScoringService, reference: ScoringService, data: ValidationData, bounds: Bounds
) -> VerificationReport:
    served_scores = torch.cat(_scores(served, data.requests))
    reference_scores = torch.cat(_scores(reference, data.requests))
    diff = (served_scores - reference_scores).abs()
    max_abs = float(diff.max())
    max_rel = float((diff / reference_scores.clamp_min(1e-12)).max())
    failures = []
    if max_abs > bounds.max_abs_score_diff:
        failures.append(f"max abs score diff {max_abs:.3e} > {bounds.max_abs_score_diff:g}")
    if bounds.max_rel_score_diff is not None and max_rel > bounds.max_rel_score_diff:
        failures.append(f"max rel score diff {max_rel:.3e} > {bounds.max_rel_score_diff:g}")
    auc_ref = auc_srv = ne_ref = ne_srv = None
    if data.labels is not None:
        labels = torch.tensor([y for request in data.labels for y in request])
        auc_ref, auc_srv = auc(reference_scores, labels), auc(served_scores, labels)
        ne_ref, ne_srv = normalized_entropy(reference_scores, labels), normalized_entropy(
            served_scores, labels
        )
        if auc_ref - auc_srv > bounds.max_auc_drop:
            failures.append(f"AUC drop {auc_ref - auc_srv:.2e} > {bounds.max_auc_drop:g}")
        if ne_srv - ne_ref > bounds.max_ne_increase:
            failures.append(f"NE increase {ne_srv - ne_ref:.2e} > {bounds.max_ne_increase:g}")
    return VerificationReport(
        source=data.source,
        requests=len(data.requests),
        items=int(served_scores.numel()),
        max_abs_score_diff=max_abs,
        max_rel_score_diff=max_rel,
        auc_reference=auc_ref,
        auc_served=auc_srv,
        ne_reference=ne_ref,
        ne_served=ne_srv,
        bounds=bounds,
        failures=tuple(failures),
    )


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    return float(binary_auroc(scores.double(), labels.long()))


def normalized_entropy(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Log loss of ``scores`` divided by the log loss of always predicting the base rate.

    1.0 is no better than the click rate alone; lower is better.
    """
    p = scores.double().clamp(1e-12, 1 - 1e-12)
    y = labels.double()
    log_loss = -(y * p.log() + (1 - y) * (1 - p).log()).mean().item()
    rate = y.mean().item()
    if rate in (0.0, 1.0):
        return math.nan
    base = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return log_loss / base


def _scores(service: ScoringService, requests: list[dict]) -> list[torch.Tensor]:
    """Click probabilities per request, through the service's own decoder and coalescer."""
    inputs = [service.decoder.decode(request).inputs for request in requests]
    scores: list[torch.Tensor] = []
    for chunk in chunk_by_items(inputs, service.schema.limits.max_items_per_forward):
        scores += [torch.sigmoid(logits) for logits in service.logits([inputs[i] for i in chunk])]
    return scores


def _item_count(request: Any) -> int:
    if isinstance(request, dict) and isinstance(request.get("items"), list):
        return len(request["items"])
    if isinstance(request, dict) and isinstance(request.get("float_features"), list):
        return len(request["float_features"])
    return -1
