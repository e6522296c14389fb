"""Which dense precision to serve: every ``dense_precision`` choice for the model's MLPs, timed and
checked against the float model on the build's validation data, so that the build can suggest the
fastest one that passes the accuracy gate and say what it costs.

    torchrec-serve build --spec criteo --compare-dense-precisions

Each choice is the eager served model (the same tables) with all its MLPs in that precision; its
forward is timed at one item (a lone request) and at ``LARGE_BATCH`` items (a full batch), on
this machine's current thread setting. The times are the eager model's. Compiled rankings at
small batches have differed from run to run here: compiled ``int8_weight_only`` was once the
fastest at one item, and in a later run of the Criteo AOTI archive slower than fp32 (241-314
against 194-210 us a forward). Time the compiled archive before you choose for latency.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from archive_tools.validation_data import ValidationData
from archive_tools.verification import Bounds, VerificationReport, verify
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import synthetic_request
from handlers.modeling.spec import DensePrecision, ModelSpec
from handlers.modeling.weights import InferenceWeights
from handlers.runtime.batching import coalesce
from handlers.runtime.service import ScoringService

LARGE_BATCH = 1024


@dataclasses.dataclass(frozen=True)
class PrecisionRow:
    precision: DensePrecision
    one_item_ms: float
    large_batch_ms: float
    report: VerificationReport


def compare_dense_precisions(
    spec: ModelSpec,
    weights: InferenceWeights,
    reference: ScoringService,
    data: ValidationData,
    bounds: Bounds,
) -> list[PrecisionRow]:
    rows = []
    for precision in DensePrecision:
        variant = spec.replace(dense_precision={name: precision for name in spec.DENSE_SUBMODULES})
        model = DLRMFactory(variant).inference_model(weights)
        service = eager_service(variant, model)
        rows.append(
            PrecisionRow(
                precision,
                _forward_ms(service, variant, 1),
                _forward_ms(service, variant, LARGE_BATCH),
                verify(service, reference, data, bounds),
            )
        )
    return rows


def suggestion_lines(rows: list[PrecisionRow]) -> list[str]:
    lines = [
        "dense precision (all MLPs, eager forward)",
        "                             1 item    1024 items  max score diff  AUC drop   gate",
    ]
    for row in rows:
        report = row.report
        drop = (
            f"{report.reference.auc - report.served.auc:+.1e}"
            if report.reference and report.served else "n/a"
        )
        lines.append(
            f"  {row.precision.value:<25}{row.one_item_ms:>7.3f} ms{row.large_batch_ms:>9.2f} ms"
            f"{report.max_abs_score_diff:>15.1e}{drop:>10}   {'passes' if report.passed else 'fails'}"
        )
    passing = [row for row in rows if row.report.passed]
    for label, key in (("one item", "one_item_ms"), ("large batches", "large_batch_ms")):
        best = min(passing, key=lambda row: getattr(row, key), default=None)
        if best is not None:
            fp32 = next(row for row in rows if row.precision == DensePrecision.FP32)
            gain = getattr(fp32, key) / getattr(best, key)
            lines.append(
                f"  fastest that passes for {label}: {best.precision.value} ({gain:.2f}x fp32; "
                f"max score diff {best.report.max_abs_score_diff:.1e})"
            )
    return lines


def _forward_ms(service: ScoringService, spec: ModelSpec, items: int, min_time_s: float = 0.3) -> float:
    parts = [min(256, items - start) for start in range(0, items, 256)]
    requests = [
        service.decoder.decode(synthetic_request(spec, n, seed=k)).inputs for k, n in enumerate(parts)
    ]
    batch = coalesce(requests, service.tags)
    model: nn.Module | object = service.model
    with torch.inference_mode():
        for _ in range(3):
            model(batch)  # type: ignore[operator]
        calls, started = 0, time.perf_counter()
        while time.perf_counter() - started < min_time_s or calls < 5:
            model(batch)  # type: ignore[operator]
            calls += 1
    return (time.perf_counter() - started) / calls * 1000
