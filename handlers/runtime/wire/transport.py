"""A request as it arrived, opened into what the decoders read: its size checked against the
model's limit, a gzip ``Content-Encoding`` decoded (bounded by that limit too), a body that came as
an HTML form refused with the fix, and a KServe v2 binary body recognised by its header length.

    opened(Arrival(body, content_type="application/json"), max_bytes=6 << 20)   # -> bytes
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

from handlers.runtime.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from handlers.runtime.wire.messages import BinaryBody

FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


class Arrival(NamedTuple):
    """``body``: the bytes as sent (None when TorchServe parsed a form into fields instead);
    ``header_length``: the KServe v2 binary extension's JSON header length, if given. (A named
    tuple: one is made per request, and it is cheap.)"""

    body: Any
    content_type: str | None = None
    content_encoding: str | None = None
    header_length: str | None = None


def opened(arrival: Arrival, max_bytes: int) -> Any:
    """The body the decoders read: bytes, a ``BinaryBody``, or what TorchServe already decoded.
    Raises ``BadRequest`` (413 too large, 415 an encoding or form it cannot read)."""
    body = arrival.body
    if body is None:
        media = (arrival.content_type or "").split(";")[0].strip().lower()
        if media in FORM_TYPES:
            raise UnsupportedMediaType(
                "Content-Type",
                f"the body arrived as a form ({media}, what curl -d sends unless told otherwise); "
                "send it as JSON: -H 'Content-Type: application/json'",
            )
    if not isinstance(body, (bytes, bytearray)):
        return body
    if len(body) > max_bytes:
        raise too_large(len(body), max_bytes)
    if arrival.content_encoding is not None:
        encoding = arrival.content_encoding.strip().lower()
        if encoding == "gzip":
            body = _gunzip(body, max_bytes)
        elif encoding not in ("identity", ""):  # an empty header names no encoding
            raise UnsupportedMediaType("Content-Encoding", f"{encoding!r} is not supported: send gzip or identity")
    if arrival.header_length is None:
        return body
    try:
        json_length = int(arrival.header_length)
    except ValueError:
        json_length = -1  # refused, naming the header, by the decoder
    return BinaryBody(body, json_length)


def too_large(size: int | None, max_bytes: int) -> PayloadTooLarge:
    """The refusal of a body of ``size`` bytes over ``max_bytes`` (None: a server stopped reading
    it past the limit, not knowing its size)."""
    if size is None:
        return PayloadTooLarge("body", f"over the model's limit of {max_bytes:,} bytes (limits.max_request_bytes)")
    return PayloadTooLarge("body", f"{size:,} bytes, over the model's limit of {max_bytes:,} (limits.max_request_bytes)")


def _gunzip(body: bytes | bytearray, max_bytes: int) -> bytes:
    """Decodes at most ``max_bytes`` (a small body may inflate without bound)."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        data = inflater.decompress(body, max_bytes + 1)
    except zlib.error as e:
        raise BadRequest("Content-Encoding", f"the body is not valid gzip: {e}", "malformed_body") from None
    if len(data) > max_bytes:
        raise PayloadTooLarge(
            "body", f"over the model's limit of {max_bytes:,} bytes once gzip-decoded (limits.max_request_bytes)"
        )
    if not inflater.eof:
        raise BadRequest("Content-Encoding", "the gzip stream ends early", "malformed_body")
    return data
