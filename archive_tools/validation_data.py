"""Validation data for the verification gate, in the shapes people export from an eval set.

``read_validation(path, spec)`` takes:

* **JSON lines** (any suffix but ``.tsv``/``.txt``), one object per line, each one of
  - ``{"request": <body>, "labels": [0, 1, ...]}``: a request body and one label per item;
  - a request body (items form, columnar form, KServe v2) carrying ``"labels": [...]`` or, for
    one item, ``"label": 0``;
  - one item record: ``{"dense": [...], "sparse": {...}, "label": 1}``;
  - a request body without labels (then no line has labels, and only score differences are
    checked);
* **a Criteo TSV** (``.tsv`` or ``.txt``): ``label``, the dense integers and the categorical hex
  ids, tab-separated, in the spec's feature order, missing values empty. As TorchRec's Criteo
  preprocessing does, a missing value is 0, a dense value x becomes ln(x - min + 2) (min over the
  file) and a hex id its integer (the spec's ``out_of_range`` policy then applies). Items go into
  requests of 64.

A line that cannot be read is a ``ValidationDataError`` naming the file, the line and the field;
so is a labelled file whose labels all agree.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
import numpy as np
import orjson

from handlers.modeling.spec import ModelSpec
from handlers.runtime.errors import InputError

TSV_SUFFIXES = (".tsv", ".txt")
TSV_ITEMS_PER_REQUEST = 64


class ValidationDataError(InputError):
    """A validation file that cannot be read; the message names the file, line and field."""


@dataclasses.dataclass(frozen=True)
class ValidationData:
    """Request bodies, per request one 0/1 label per item where labels exist, and where each
    request came from (``source:line``), for errors that name the line."""

    requests: list[dict]
    labels: list[list[int]] | None
    source: str
    origins: list[str]


def read_validation(path: Path, spec: ModelSpec) -> ValidationData:
    path = Path(path)
    data = _read_criteo_tsv(path, spec) if path.suffix in TSV_SUFFIXES else _read_jsonl(path)
    if data.labels is not None:
        seen = {label for request in data.labels for label in request}
        if len(seen) == 1:  # AUC is undefined, NE divides by nothing: no bound could be checked
            raise ValidationDataError(f"{path}: every label is {seen.pop()}: AUC and NE need clicks and non-clicks")
    return data


def _read_jsonl(path: Path) -> ValidationData:
    requests: list[dict] = []
    labels: list[list[int] | None] = []
    origins: list[str] = []
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise ValidationDataError(f"{where}: not JSON: {e}") from None
        if not isinstance(row, dict):
            raise ValidationDataError(f"{where}: must be a JSON object, got {type(row).__name__}")
        request, request_labels = _record(row, where)
        requests.append(request)
        labels.append(request_labels)
        origins.append(where)
    if not requests:
        raise ValidationDataError(f"{path}: no requests")
    labelled = sum(label is not None for label in labels)
    if labelled not in (0, len(labels)):
        first = origins[next(i for i, lab in enumerate(labels) if lab is None)]
        raise ValidationDataError(f"{first}: has no label, while other lines do: label every line or none")
    return ValidationData(requests, labels if labelled else None, f"file {path}", origins)  # type: ignore[arg-type]


def _record(row: dict, where: str) -> tuple[dict, list[int] | None]:
    """One JSON line -> (request body, its labels or None)."""
    if "request" in row:
        unknown = set(row) - {"request", "labels"}
        if unknown:
            raise ValidationDataError(f"{where}: {sorted(unknown)[0]}: unknown field beside 'request'")
        request, labels = row["request"], row.get("labels")
    else:
        request = dict(row)
        if "label" in request and "labels" in request:
            raise ValidationDataError(f"{where}: label: give 'label' or 'labels', not both")
        labels = [request.pop("label")] if "label" in request else request.pop("labels", None)
        if "dense" in request:  # one item record
            request = {"items": [request]}
    if not isinstance(request, dict):
        raise ValidationDataError(f"{where}: request: must be a JSON object")
    if labels is None:
        return request, None
    field = "labels" if "labels" in row else "label"
    if not isinstance(labels, list) or not all(label in (0, 1) and type(label) is not float for label in labels):
        raise ValidationDataError(f"{where}: {field}: labels must be 0 or 1, got {labels!r}")
    items = _item_count(request)
    if items is not None and len(labels) != items:
        raise ValidationDataError(
            f"{where}: {field}: one label per item: the request has {items} items, got {len(labels)} labels"
        )
    return request, [int(label) for label in labels]


def _item_count(request: dict) -> int | None:
    """Items in a request body, where its form says (None: left to the decoder to judge)."""
    if isinstance(request.get("items"), list):
        return len(request["items"])
    dense = request.get("float_features")
    if isinstance(dense, list) and dense and isinstance(dense[0], list):
        return len(dense)
    return None


def _read_criteo_tsv(path: Path, spec: ModelSpec) -> ValidationData:
    num_dense, features = spec.dense_features, spec.feature_names
    labels, dense_rows, sparse_rows, origins = [], [], [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        fields = line.split("\t")
        if len(fields) != 1 + num_dense + len(features):
            raise ValidationDataError(
                f"{where}: a Criteo line holds a label, {num_dense} dense and {len(features)} "
                f"categorical fields ({1 + num_dense + len(features)} tab-separated), got {len(fields)}"
            )
        labels.append(_tsv_int(fields[0], 10, where, "label", (0, 1)))
        dense_rows.append(
            [_tsv_int(v, 10, where, f"dense field {i + 1}") for i, v in enumerate(fields[1 : 1 + num_dense])]
        )
        sparse_rows.append(
            [_tsv_int(v, 16, where, f"categorical field {features[i]}") for i, v in enumerate(fields[1 + num_dense :])]
        )
        origins.append(where)
    if not labels:
        raise ValidationDataError(f"{path}: no lines")
    dense = np.asarray(dense_rows, dtype=np.float64)
    dense = np.log(dense - dense.min() + 2)
    requests, request_labels, request_origins = [], [], []
    for start in range(0, len(labels), TSV_ITEMS_PER_REQUEST):
        rows = range(start, min(start + TSV_ITEMS_PER_REQUEST, len(labels)))
        items = [
            {"dense": dense[r].round(6).tolist(), "sparse": dict(zip(features, ([i] for i in sparse_rows[r])))}
            for r in rows
        ]
        requests.append({"items": items})
        request_labels.append([labels[r] for r in rows])
        request_origins.append(f"{origins[rows[0]]}-{origins[rows[-1]].rsplit(':', 1)[1]}")
    return ValidationData(requests, request_labels, f"Criteo TSV {path}", request_origins)


def _tsv_int(text: str, base: int, where: str, field: str, allowed: tuple[int, ...] = ()) -> int:
    try:
        value = int(text, base) if text else 0
    except ValueError:
        kind = "hex id" if base == 16 else "integer"
        raise ValidationDataError(f"{where}: {field}: must be an {kind}, got {text!r}") from None
    if allowed and value not in allowed:
        raise ValidationDataError(f"{where}: {field}: must be one of {list(allowed)}, got {value}")
    return value

