"""The model on the rows its data looks up: what the planner evaluates, many times, cheaply.

A table of 40M rows is looked up at a few thousand distinct ids by any validation set. The probe
keeps only those rows: a copy of the model whose tables hold, in order, the rows of the ids the
data uses (``TableSpec.rows`` becomes their count), and the data's ids renumbered to match. Row-wise
quantization treats each row alone, so the probe's rows in any dtype are exactly the full table's
served rows for those ids, and its scores are the full model's.

    probe = TableProbe(spec, FloatTables(float_model), {"plan": plan_data, "holdout": holdout_data})
    probe.quality("plan", {"t_user": WeightDtype.INT4})       # float model, one table as int4
    probe.served_quality("holdout", dtypes)                    # the served model: quantized, dense precision,
                                                               # with its AUC drop's bootstrap interval

``quality`` rounds the chosen tables' float rows through their served format in place (fast, and
the same embeddings the kernels look up); ``served_quality`` builds the quantized model with the
factory, as an archive serves it (dense precision included), for the final word.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Mapping, Protocol, Sequence

import torch
from torch import nn

from archive_tools.planning.uncertainty import auc_drop_interval
from archive_tools.validation_data import ValidationData, ValidationDataError
from archive_tools.verification import Quality, quality
from handlers.modeling.eager import eager_service
from handlers.modeling.embedding_modules import table_prefixes, table_weights
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.row_formats import decode_rows, round_trip
from handlers.modeling.spec import ModelSpec, WeightDtype
from handlers.modeling.weights import InferenceWeights
from handlers.runtime.batching import chunk_by_items
from handlers.runtime.inputs import BatchKind, InputTag, JaggedIds, RequestInputs
from handlers.runtime.service import ScoringService
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.messages import Rejected
from handlers.modeling.registry import input_schema

Dtypes = Mapping[str, WeightDtype]  # table -> dtype; a table not named stays float
Zeroed = Mapping[str, torch.Tensor]  # table -> bool [probe rows]: rows of pruned ids, served as zeros


class _Split:
    """One data split, decoded and renumbered into the probe's rows."""

    def __init__(self, requests: list[RequestInputs], labels: torch.Tensor, source: str) -> None:
        self.requests = requests
        self.labels = labels
        self.source = source


@dataclasses.dataclass(frozen=True)
class Served:
    """The served model's quality on a split, against the float model's scores on it."""

    quality: Quality
    max_abs_score_diff: float
    auc_drop_ci95: tuple[float, float]  # paired bootstrap interval of the float AUC minus this one


class TableProbe:
    def __init__(self, spec: ModelSpec, tables: "Tables", splits: Mapping[str, ValidationData]) -> None:
        decoded = {name: _decode(spec, data) for name, data in splits.items()}
        self.spec = spec
        self._tags = _jagged_tags(spec)
        self._table_of = {f: t.name for t in spec.tables for f in t.features}
        self.used_ids = _used_ids(spec, [r for requests, _ in decoded.values() for r in requests])
        self.compact_spec = spec.replace(
            tables=[t.model_copy(update={"rows": max(1, len(self.used_ids[t.name]))}) for t in spec.tables]
        )
        self.splits = {
            name: _Split([self._renumber(r) for r in requests], labels, splits[name].source)
            for name, (requests, labels) in decoded.items()
        }
        self.reference = tables.reference
        self.model = _compact_model(self.compact_spec, tables, self.used_ids)
        self._float_rows = {name: w.detach().clone() for name, w in table_weights(self.model).items()}
        self._service = eager_service(self.compact_spec, self.model)
        self.evaluations = 0  # forwards over a whole split, for the report
        self._float_scores: dict[str, torch.Tensor] = {}

    def quality(self, split: str, dtypes: Dtypes, zeroed: Zeroed = {}) -> Quality:
        """The float model's quality on ``split`` with the named tables' rows as their dtype serves
        them, and ``zeroed`` rows zero."""
        with self._rows(dtypes, zeroed):
            return quality(self._run(self._service, split), self.splits[split].labels)

    def served_quality(self, split: str, dtypes: Dtypes, zeroed: Zeroed = {}) -> "Served":
        """The served model on ``split``: tables quantized to ``dtypes`` (float where not named) by
        the factory, dense layers in the spec's precision. A zero row quantizes to zeros, so
        ``zeroed`` rows serve what a pruned table's kernels give its pruned ids."""
        spec = self.compact_spec.replace(
            tables=[t.model_copy(update={"weight_dtype": dtypes.get(t.name, WeightDtype.FP32)}) for t in self.compact_spec.tables]
        )
        factory = DLRMFactory(spec)
        with self._rows({}, zeroed):
            served = eager_service(spec, factory.inference_model(factory.quantize(self.model)))
        scores = self._run(served, split)
        if split not in self._float_scores:
            self._float_scores[split] = self._run(self._service, split)
        reference, labels = self._float_scores[split], self.splits[split].labels
        return Served(
            quality(scores, labels), float((scores - reference).abs().max()), auc_drop_interval(reference, scores, labels)
        )

    @contextlib.contextmanager
    def _rows(self, dtypes: Dtypes, zeroed: Zeroed) -> Iterator[None]:
        """Within the block the model's tables hold their rows as ``dtypes`` serve them, ``zeroed`` zero."""
        weights = table_weights(self.model)
        with torch.no_grad():
            for name, rows in self._float_rows.items():
                dtype = dtypes.get(name, WeightDtype.FP32)
                weights[name].copy_(rows if dtype == WeightDtype.FP32 else round_trip(rows, dtype.value))
                if name in zeroed:
                    weights[name][zeroed[name]] = 0.0
        try:
            yield
        finally:
            with torch.no_grad():
                for name, rows in self._float_rows.items():
                    weights[name].copy_(rows)

    def _run(self, service: ScoringService, split: str) -> torch.Tensor:
        """Click probabilities [items] of ``split``."""
        data = self.splits[split]
        self.evaluations += 1
        logits: list[torch.Tensor] = []
        for chunk in chunk_by_items(data.requests, self.spec.limits.max_items_per_forward):
            logits += service.logits([data.requests[i] for i in chunk])
        return torch.sigmoid(torch.cat(logits))

    def _renumber(self, request: RequestInputs) -> RequestInputs:
        """The request with each id replaced by its row in the probe's tables."""
        tensors = dict(request.tensors)
        for tag, ids in _jagged(self._tags, request):
            parts = ids.per_feature()
            renumbered = [
                torch.searchsorted(self.used_ids[self._table_of[feature]], part)
                for feature, part in zip(tag.keys, parts)
            ]
            values = torch.cat(renumbered) if renumbered else ids.values
            tensors[tag.name] = JaggedIds(ids.lengths, values, ids.weights)
        return RequestInputs(request.num_items, tensors, request.item_counts)


def require_labels(data: ValidationData) -> list[list[int]]:
    if data.labels is None:
        raise ValidationDataError(f"{data.source}: planning needs labels (label or labels on every line)")
    return data.labels


def _decode(spec: ModelSpec, data: ValidationData) -> tuple[list[RequestInputs], torch.Tensor]:
    """The data's requests as the model's inputs (ids checked or hashed as served), and its labels."""
    labelled = require_labels(data)
    decoder = RequestDecoder(input_schema(spec))
    requests = []
    for request, labels, origin in zip(data.requests, labelled, data.origins):
        try:
            inputs = decoder.decode(request).inputs
        except Rejected as refusal:
            raise ValidationDataError(f"{origin}: {refusal.error.message}") from None
        if len(labels) != inputs.num_items:
            raise ValidationDataError(
                f"{origin}: labels: one label per item: the request has {inputs.num_items} items, got {len(labels)}"
            )
        requests.append(inputs)
    return requests, torch.tensor([y for labels in labelled for y in labels])


def count_ids(spec: ModelSpec, data: ValidationData) -> dict[str, torch.Tensor]:
    """How often ``data``'s requests look each id up (as served: checked or hashed), per table:
    int64 [rows] (the usage pruning ranks rows by)."""
    decoder = RequestDecoder(input_schema(spec))
    table_of = {f: t.name for t in spec.tables for f in t.features}
    looked_up: dict[str, list[torch.Tensor]] = {t.name: [] for t in spec.tables}
    tags = _jagged_tags(spec)
    for request, origin in zip(data.requests, data.origins):
        try:
            inputs = decoder.decode(request).inputs
        except Rejected as refusal:
            raise ValidationDataError(f"{origin}: {refusal.error.message}") from None
        for tag, ids in _jagged(tags, inputs):
            for feature, part in zip(tag.keys, ids.per_feature()):
                looked_up[table_of[feature]].append(part)
    return {  # one count per table: a table of 40M rows is allocated once, not per request
        t.name: torch.bincount(torch.cat(looked_up[t.name]) if looked_up[t.name] else torch.zeros(0, dtype=torch.int64),
                               minlength=t.rows)
        for t in spec.tables
    }


def _jagged_tags(spec: ModelSpec) -> list[InputTag]:
    return [t for t in input_schema(spec).tags if t.kind in (BatchKind.JAGGED, BatchKind.CONTEXT_JAGGED)]


def _jagged(tags: Sequence[InputTag], request: RequestInputs) -> Iterator[tuple[InputTag, JaggedIds]]:
    """The request's ids: each jagged input's tag (its keys: the features) and tensors."""
    for tag in tags:
        yield tag, request.tensors[tag.name]  # type: ignore[misc]


def _used_ids(spec: ModelSpec, requests: Sequence[RequestInputs]) -> dict[str, torch.Tensor]:
    """Each table's ids looked up anywhere in ``requests``, sorted and distinct (int64)."""
    table_of = {f: t.name for t in spec.tables for f in t.features}
    found: dict[str, list[torch.Tensor]] = {t.name: [] for t in spec.tables}
    tags = _jagged_tags(spec)
    for request in requests:
        for tag, ids in _jagged(tags, request):
            for feature, part in zip(tag.keys, ids.per_feature()):
                found[table_of[feature]].append(part)
    return {
        name: torch.unique(torch.cat(parts)) if parts else torch.zeros(0, dtype=torch.int64)
        for name, parts in found.items()
    }


def _compact_model(compact: ModelSpec, tables: "Tables", used_ids: Mapping[str, torch.Tensor]) -> nn.Module:
    """``compact``'s float model: the dense layers of ``tables``'s model, and per table the rows of its used ids."""
    model = DLRMFactory(compact).float_model(seed=0)
    missing, unexpected = model.load_state_dict(tables.dense, strict=False)
    if unexpected or [k for k in missing if not k.startswith(table_prefixes(model))]:
        raise ValueError(f"the probe's model does not take the model's dense weights: {missing + unexpected}")
    with torch.no_grad():
        for name, weight in table_weights(model).items():
            ids = used_ids[name]
            if len(ids):
                weight.copy_(tables.rows(name, ids))
    return model.eval()


class Tables(Protocol):
    """Where the probe's rows come from, and what the plan is measured against."""

    reference: str  # what the reference model is, for the report
    dense: dict[str, torch.Tensor]  # the model's float dense weights, by state-dict name
    widest: dict[str, WeightDtype]  # per table the widest dtype a plan may choose (none named: fp32)

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """float [len(ids), dim]: the table's rows of ``ids``."""
        ...


class FloatTables:
    """A trained float model's tables: the plan is measured against the model as trained."""

    reference = "the float model"
    widest: dict[str, WeightDtype] = {}

    def __init__(self, model: nn.Module) -> None:
        self._weights = table_weights(model)
        prefixes = table_prefixes(model)
        self.dense = {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self._weights[table][ids].detach()


class ServedTables:
    """Tables as served, for a model too large to hold in float: the plan is measured against
    them, and can only narrow each table's dtype."""

    def __init__(self, spec: ModelSpec, weights: InferenceWeights) -> None:
        self._weights = weights.tables
        self._tables = {t.name: t for t in spec.tables}
        self.dense = weights.dense
        self.widest = {t.name: t.weight_dtype for t in spec.tables}
        dtypes = sorted({t.weight_dtype.value for t in spec.tables})
        self.reference = f"the tables as the spec serves them ({', '.join(dtypes)}): the float model is not held"

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        values, scale_bias = self._weights[table]
        packed = values[ids] if scale_bias is None else torch.cat([scale_bias[ids], values[ids]], dim=1)
        spec = self._tables[table]
        return decode_rows(packed, spec.weight_dtype.value, spec.dim)
