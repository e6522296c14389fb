"""Typed serving errors, and the one place they map to HTTP status codes.

Bad client input is a ``BadRequest`` (400) naming the field, e.g. ``items[3].dense``; it is raised
while decoding one request and never affects the other requests of a TorchServe batch.
"""

from __future__ import annotations


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
    """Malformed or out-of-contract input: 400, with the field that is wrong."""

    status = 400

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}", field)


class InternalError(ServingError):
    """The model failed on input that passed validation: 500, logged with its traceback."""

    status = 500
