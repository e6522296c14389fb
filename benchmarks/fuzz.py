"""Malformed requests for the reliability suite's fuzzing phase, mutated from valid ones."""

from __future__ import annotations

import gzip
import random

import orjson


def fuzz_cases(bodies: list[bytes], count: int, seed: int) -> list[tuple[bytes, dict]]:
    """``count`` malformed requests, each (body, headers), mutated from the valid ``bodies``."""
    rng = random.Random(seed)
    json_headers = {"Content-Type": "application/json"}
    values = ["NaN", "Infinity", "-1", "1e400", "123456789012345678901234567890", '"x"', "null", "true",
              "[]", "{}", "[[[[1]]]]", "-0.0", '"\\u0000"', "1.5"]

    def mutate(body: bytes) -> tuple[bytes, dict]:
        kind = rng.randrange(10)
        text = body.decode()
        if kind == 0:  # truncated
            return body[: rng.randrange(len(body))], json_headers
        if kind == 1:  # random bytes flipped
            data = bytearray(body)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            return bytes(data), json_headers
        if kind in (2, 3):  # a number or list replaced by another JSON value
            spots = [i for i, c in enumerate(text) if c in "0123456789["]
            at = rng.choice(spots)
            end = at + 1
            while end < len(text) and text[end] not in ",]}":
                end += 1
            return (text[:at] + rng.choice(values) + text[end:]).encode(), json_headers
        if kind == 4:  # a key repeated, renamed, or unknown
            parsed = orjson.loads(body)
            key = rng.choice(list(parsed))
            return text.replace(f'"{key}"', f'"{key}x"', 1).encode() if rng.random() < 0.5 else (
                text[:-1] + f', "{key}": {orjson.dumps(parsed[key]).decode()}}}'
            ).encode(), json_headers
        if kind == 5:  # not an object
            return rng.choice([b"[]", b'"items"', b"42", b"null", b"", b" ", b"{", b"\xff\xfe"]), json_headers
        if kind == 6:  # nested beyond any parser's depth
            depth = rng.choice([100, 1000, 100_000])
            return b'{"items": ' + b"[" * depth + b"]" * depth + b"}", json_headers
        if kind == 7:  # a form, or no content type
            return body, rng.choice([{"Content-Type": "application/x-www-form-urlencoded"}, {}])
        if kind == 8:  # encodings
            encoding = rng.choice(["gzip", "br", "deflate"])
            data = gzip.compress(body) if encoding == "gzip" and rng.random() < 0.5 else body
            return data, {**json_headers, "Content-Encoding": encoding}
        items = orjson.loads(body).get("items", [{}])  # many items
        return orjson.dumps({"items": items * rng.choice([1000, 5000])}), json_headers

    return [mutate(bodies[rng.randrange(len(bodies))]) for _ in range(count)]
