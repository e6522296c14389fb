"""Typed serving errors, and the one place they map to HTTP status codes.

Bad client input is a ``BadRequest`` (400) naming the field, e.g. ``items[3].dense``; it is raised
while decoding one request and never affects the other requests of a TorchServe batch.
"""

from __future__ import annotations


class InputError(ValueError):
    """What someone gave the project is wrong (an option, a file, an archive's config, a spec):
    the message names it and the problem, in one line. The commands print it as it is; anything
    else that escapes them is the project's own fault, shown as an internal error."""


class ServingError(Exception):
    """Base of errors that become an HTTP response for one request."""

    status: int = 500

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_body(self) -> dict:
        body: dict = {"code": self.status, "type": type(self).__name__, "message": self.message}
        if self.field is not None:
            body["field"] = self.field
        return body


class BadRequest(ServingError):
    """Malformed or out-of-contract input: 400, with the field that is wrong and a ``reason`` from
    ``REASONS`` (the rejected-requests metric counts by it)."""

    status = 400
    REASONS = (
        "malformed_body", "unknown_field", "missing_field", "bad_value", "too_large",
        "id_out_of_range", "unsupported_media", "model_refused",
    )

    def __init__(self, field: str, problem: str, reason: str = "bad_value") -> None:
        super().__init__(f"{field}: {problem}", field)
        self.reason = reason


class ModelRefused(BadRequest):
    """The model raised on this request alone, on its shapes or values (an assertion, an index
    or size error: e.g. two ids where it takes one), while the requests batched beside it were
    scored: 400, naming the model's error."""

    def __init__(self, error: Exception) -> None:
        message = str(error).strip().splitlines()[0][:300] if str(error).strip() else "(no message)"
        super().__init__("request", f"the model cannot score it: {type(error).__name__}: {message}", "model_refused")


class PayloadTooLarge(BadRequest):
    """A body over the model's ``limits.max_request_bytes``: 413."""

    status = 413

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem, "too_large")


class UnsupportedMediaType(BadRequest):
    """A body in an encoding or form the handler does not read: 415, naming what to send."""

    status = 415

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem, "unsupported_media")


class Conflict(ServingError):
    """The call is sound but the model's state refuses it now (a rollback under way, an archive
    that takes no deltas): 409, saying why."""

    status = 409


class InternalError(ServingError):
    """The model failed on input that passed validation: 500, logged with its traceback."""

    status = 500


class ShardUnavailable(ServingError):
    """No replica of an embedding shard answered within its deadline (``handlers.runtime.remote``):
    503, naming the shard, how long it was tried and what each replica said."""

    status = 503

    def __init__(self, shard: str, waited_ms: float, errors: list[str]) -> None:
        super().__init__(
            f"embedding shard {shard!r} unavailable: no replica answered within {waited_ms:.0f} ms "
            f"({'; '.join(errors)})",
            "shard",
        )
        self.shard = shard


# The errors a server answers before a request reaches the model. Their class names are the
# ``type`` TorchServe's answers carry, so that a client reads the same body from either engine.


class InvalidKeyException(ServingError):
    """A missing or wrong key: 400, as TorchServe's token authorization answers it."""

    status = 400

    def __init__(self) -> None:
        super().__init__("Token Authorization failed. Token either incorrect, expired, or not provided correctly")


class ModelNotFoundException(ServingError):
    """No model (or no such version of it) is served under that name: 404."""

    status = 404


class ServiceUnavailable(ServingError):
    """The model's queue is over its wait target (or full): 503 at once, retried with backoff."""

    status = 503
