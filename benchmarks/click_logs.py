"""Public click logs into what the planner reads: a Criteo TSV, and for a libfm log its spec.

``merge_criteo(paths, out)``: Criteo lines (label, 13 integer, 26 hex categorical fields) from
tab-separated files without a header or comma-separated ones with one (integers may be written as
floats, ``260.0``), into one TSV; a line seen before (most public samples are the head of the same
``train.txt``) is written once.

``libfm_to_criteo(paths, out, name, fields)``: a libfm log with one id per field on every line
(``-1 204:1 4798:1 ...``, global feature indices, the i-th id of a line in field i) into a TSV in the
Criteo layout and a DLRM spec: a table per field, its rows the field's distinct ids (mapped in order
to 0..rows-1), labels -1 -> 0. A libfm log has no dense feature and a DLRM spec needs one: every
line gets one constant dense value (0), which the model can only learn a constant from.

    merged = merge_criteo([Path("train_examples.txt"), Path("criteo_sample.txt")], Path("criteo.tsv"))
    spec, tsv = libfm_to_criteo([Path("frappe.validation.libfm")], Path("out"), "frappe", FRAPPE_FIELDS)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from handlers.modeling.registry import parse_spec

CRITEO_INTEGERS, CRITEO_CATEGORICALS = 13, 26
FRAPPE_FIELDS = ("user", "item", "daytime", "weekday", "isweekend", "homework", "cost", "weather", "country", "city")
LIBFM_DIM = 64
LIBFM_MLPS = {"bottom_mlp": [LIBFM_DIM], "top_mlp": [256, 128, 1]}  # one constant dense input: one layer
LIMITS = {"max_items_per_request": 1024, "max_ids_per_bag": 64, "max_items_per_forward": 2048}


class ClickLogError(ValueError):
    """A click-log line that cannot be converted; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class Merged:
    path: Path
    lines_read: dict[str, int]  # per source file
    distinct: int  # lines written


def merge_criteo(paths: list[Path], out: Path) -> Merged:
    """The distinct Criteo lines of ``paths``, in order of first sight, as one TSV at ``out``."""
    seen: dict[tuple[str, ...], None] = {}
    read = {}
    for path in paths:
        lines = path.read_text().splitlines()
        if lines and lines[0].split(",")[0].split("\t")[0].strip().lower() == "label":
            lines = lines[1:]  # a header
        for number, line in enumerate(lines, start=1):
            if line.strip():
                seen.setdefault(_criteo_fields(line, f"{path}:{number}"), None)
        read[str(path)] = sum(bool(line.strip()) for line in lines)
    out.write_text("".join("\t".join(fields) + "\n" for fields in seen))
    return Merged(out, read, len(seen))


def _criteo_fields(line: str, where: str) -> tuple[str, ...]:
    """One line's 40 fields, integers written as integers (``260.0`` -> ``260``)."""
    fields = line.rstrip("\r\n").split("\t" if "\t" in line else ",")
    if len(fields) != 1 + CRITEO_INTEGERS + CRITEO_CATEGORICALS:
        raise ClickLogError(f"{where}: a Criteo line holds {1 + CRITEO_INTEGERS + CRITEO_CATEGORICALS} fields, got {len(fields)}")
    numbers = []
    for i, text in enumerate(fields[: 1 + CRITEO_INTEGERS]):
        try:
            value = float(text) if text else None
        except ValueError:
            raise ClickLogError(f"{where}: field {i + 1}: must be a number, got {text!r}") from None
        if value is not None and not value.is_integer():
            raise ClickLogError(f"{where}: field {i + 1}: must be an integer, got {text!r}")
        numbers.append("" if value is None else str(int(value)))
    return (*numbers, *fields[1 + CRITEO_INTEGERS :])


def libfm_to_criteo(paths: list[Path], out: Path, name: str, fields: tuple[str, ...]) -> tuple[Path, Path]:
    """``out/NAME.yaml`` (the spec) and ``out/NAME.tsv`` (every line of ``paths``, in order)."""
    labels: list[int] = []
    rows: list[list[int]] = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                label, ids = _libfm_line(line, f"{path}:{number}", len(fields))
                labels.append(label)
                rows.append(ids)
    if not rows:
        raise ClickLogError(f"{', '.join(map(str, paths))}: no lines")
    distinct = [sorted({ids[i] for ids in rows}) for i in range(len(fields))]
    index = [{feature: row for row, feature in enumerate(ids)} for ids in distinct]
    out.mkdir(parents=True, exist_ok=True)
    tsv = out / f"{name}.tsv"
    tsv.write_text("".join(
        "\t".join([str(label), "0", *(format(index[i][v], "x") for i, v in enumerate(ids))]) + "\n"
        for label, ids in zip(labels, rows)
    ))
    spec = parse_spec({
        "name": name,
        "dense_features": 1,
        **LIBFM_MLPS,
        "tables": [
            {"name": f"t_{field}", "rows": len(ids), "dim": LIBFM_DIM, "features": [field], "weight_dtype": "int8"}
            for field, ids in zip(fields, distinct)
        ],
        "limits": LIMITS,
    })
    spec_path = out / f"{name}.yaml"
    spec.to_yaml(spec_path)
    return spec_path, tsv


def _libfm_line(line: str, where: str, fields: int) -> tuple[int, list[int]]:
    """(label 0/1, the global feature index of each field)."""
    label, *pairs = line.split()
    if label not in ("-1", "1", "0"):
        raise ClickLogError(f"{where}: label: must be -1, 0 or 1, got {label!r}")
    if len(pairs) != fields:
        raise ClickLogError(f"{where}: one id per field: {fields} fields, got {len(pairs)} ids")
    ids = []
    for pair in pairs:
        feature, _, value = pair.partition(":")
        if not feature.isdigit() or value not in ("1", "1.0"):
            raise ClickLogError(f"{where}: {pair!r}: must be index:1 (one categorical id)")
        ids.append(int(feature))
    return int(label == "1"), ids
