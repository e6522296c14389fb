"""JSON values -> typed arrays, strictly: every refusal is a ``BadRequest`` naming the spot.

``locate(k)`` callbacks turn the index of a bad value into its field path, so these helpers stay
free of any request layout.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import numpy as np
import orjson

from handlers.runtime.errors import BadRequest

Locate = Callable[[int], str]

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def parse_json(payload: Any) -> Any:
    """Strict JSON: NaN and Infinity are malformed. A payload that TorchServe already decoded
    (``decode_input_request=true``) may hold them; the finite checks on values catch them."""
    if isinstance(payload, (bytes, bytearray, memoryview, str)):
        try:
            return orjson.loads(payload)
        except orjson.JSONDecodeError as e:
            raise BadRequest("body", f"malformed JSON: {e}", "malformed_body") from None
    if payload is None:
        raise BadRequest("body", "empty request body", "malformed_body")
    return payload


def refuse_duplicate_keys(raw: Any, keys: int) -> None:
    """A ``BadRequest`` naming a key given twice in one object of the JSON text ``raw``, whose
    parse holds ``keys`` keys (JSON parsers keep the last value of a repeated key silently).

    Quick check: each key of the text is followed by one colon, and colons elsewhere are inside
    strings, so a text with exactly ``keys`` colons repeats none. Otherwise (a duplicate, or
    colons in strings) the text is parsed again, slowly, to name the key."""
    if not isinstance(raw, (bytes, bytearray, memoryview, str)):
        return  # decoded by TorchServe already: repeated keys are gone
    text = raw.encode() if isinstance(raw, str) else bytes(raw)
    if text.count(b":") == keys:
        return

    def unique(pairs: list[tuple[str, Any]]) -> dict:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadRequest(key, "given twice in one JSON object; give each key once", "malformed_body")
            seen.add(key)
        return dict(pairs)

    json.loads(text, object_pairs_hook=unique)


def finite_float32s(flat: list[Any], locate: Locate) -> np.ndarray:
    """JSON numbers -> float32 array; non-numbers and values beyond float32 are a ``BadRequest``."""
    if not set(map(type, flat)) <= {int, float}:
        k = next(k for k, v in enumerate(flat) if type(v) not in (int, float))
        raise BadRequest(locate(k), f"must be a number, got {flat[k]!r}")
    try:
        with np.errstate(over="ignore"):  # beyond float32 becomes inf, refused below
            values = np.array(flat, dtype=np.float64).astype(np.float32)
    except OverflowError:  # an integer beyond float64
        values = None
    if values is None or not np.isfinite(values).all():
        k = next(k for k, v in enumerate(flat) if not abs(v) <= _FLOAT32_MAX)  # NaN fails too
        raise BadRequest(locate(k), f"must be finite in float32, got {flat[k]!r}")
    return values


def float_rows(rows: list[Any], width: int, field_of: Locate) -> np.ndarray:
    """[n] JSON rows of ``width`` finite numbers -> float32 [n, width]; ``field_of(i)`` names row i."""
    check_row_shapes(rows, width, field_of)
    flat = [v for row in rows for v in row]
    values = finite_float32s(flat, lambda k: f"{field_of(k // width)}[{k % width}]")
    return values.reshape(len(rows), width)


def check_row_shapes(rows: list[Any], width: int, field_of: Locate) -> None:
    """A ``BadRequest`` at the first of ``rows`` that is not a list of ``width`` values."""
    for i, row in enumerate(rows):
        if not isinstance(row, list):
            raise BadRequest(field_of(i), f"must be a list of {width} numbers, got {json_type(row)}")
        if len(row) != width:
            raise BadRequest(field_of(i), f"must hold {width} numbers, got {len(row)}")


def int_array(values: list[Any], locate: Locate) -> np.ndarray:
    """JSON integers -> int64 array; bools, floats, strings and huge ints are a ``BadRequest``."""
    if not set(map(type, values)) <= {int}:
        k = next(k for k, v in enumerate(values) if type(v) is not int)
        value = values[k]
        if type(value) is float and abs(value) >= 2**63:  # orjson reads an integer past int64 as a float
            raise BadRequest(locate(k), f"must be an integer id within int64's range, got {value!r}")
        raise BadRequest(locate(k), f"must be an integer id, got {value!r}")
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        k = next(k for k, v in enumerate(values) if not -(2**63) <= v < 2**63)
        raise BadRequest(locate(k), f"integer {values[k]} is out of int64 range") from None


def reject_unknown(obj: dict, allowed: set[str] | frozenset[str], prefix: str) -> None:
    unknown = obj.keys() - allowed
    if unknown:
        raise BadRequest(f"{prefix}{sorted(unknown)[0]}", "unknown field", "unknown_field")


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "NaN" if isinstance(value, float) and math.isnan(value) else "number"
    return {dict: "object", list: "array", str: "string", type(None): "null"}.get(
        type(value), type(value).__name__
    )
