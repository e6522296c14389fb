"""Every use of TorchServe's Python worker beyond its handler API, in one place (the frontend's
are the plugin's ``Internals.java``); ``tests/test_torchserve_contracts.py`` fails by name when a
TorchServe release changes what these rely on.

* ``read_frames_buffered``: the worker's reader of the frontend's messages. TorchServe's own
  (``ts.protocol.otf_message_handler.retrieve_msg``) reads every field of a message with a
  ``recv`` of its own: a 4-byte length, then the bytes, 26 system calls and twice as many
  Python calls for a one-item request with four HTTP headers, 31 us a request in process
  (``torchserve_read_us_per_request`` of the speed benchmark), more than the handler's own work.
  ``FrameReader`` reads the socket in 64 KiB chunks and parses an inference message from its
  buffer (5.5 us a request), giving the service exactly what TorchServe's reader gives it
  (``requestId``, ``headers``, ``parameters``, the same types). Any other message (a model
  load) goes through TorchServe's reader, fed from the same buffer. ``inference_message``
  writes the frontend's side of the frame, for tests and benchmarks.

The worker's loop (``TorchModelServiceWorker.handle_connection``) looks ``retrieve_msg`` up in
its module's globals for every message; the worker runs that module as ``__main__``.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
from typing import Any, Callable, NamedTuple, Sequence

from ts.protocol import otf_message_handler

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 16
INFERENCE = b"I"
LOAD = b"L"
_LENGTH = struct.Struct("!i")  # every length in the frame: big-endian int32, -1 ends a list


class FramedRequest(NamedTuple):
    """One request of an inference message: its id, HTTP headers, and parameters (name, content
    type, value): a REST body is one parameter, ``body``; a form or a gRPC request has several."""

    request_id: bytes
    headers: dict[bytes, bytes]
    parameters: Sequence[tuple[bytes, bytes, bytes]]


def inference_message(requests: Sequence[FramedRequest]) -> bytes:
    """The frontend's inference message for ``requests``, as ``FrameReader`` reads it (tests and
    benchmarks feed both readers with it)."""

    def string(value: bytes) -> bytes:
        return _LENGTH.pack(len(value)) + value

    end = _LENGTH.pack(-1)
    frame = bytearray(INFERENCE)
    for request in requests:
        frame += string(request.request_id)
        frame += b"".join(string(name) + string(value) for name, value in request.headers.items()) + end
        frame += b"".join(string(name) + string(kind) + string(value) for name, kind, value in request.parameters)
        frame += end
    return bytes(frame + end)


class FrameReader:
    """The frontend's socket read through one buffer.

    An inference message is ``b"I"``, then its requests, then -1; a request is its id, its
    headers (name, value) up to -1, and its parameters (name, content type, value) up to -1;
    every string is an int32 length and that many bytes. Parsed into what TorchServe's reader
    returns (with the frontend's bodies undecoded: ``decode_input_request=false``):
    ``[{"requestId": bytearray, "headers": [{"name": bytearray, "value": bytearray}],
    "parameters": [{"name": str, "contentType": str, "value": bytearray}]}]``.
    """

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self._buffer = bytearray()
        self._at = 0  # the first unread byte of the buffer

    def message(self) -> tuple[bytearray, Any]:
        """The next message: (command, its contents) as ``retrieve_msg`` returns them."""
        command = self._take(1)
        if command == INFERENCE:
            return command, self._requests()
        if command == LOAD:
            return command, otf_message_handler._retrieve_load_msg(self)
        raise ValueError(f"Invalid command: {command!r}")

    def recv(self, length: int) -> bytearray:
        """At most ``length`` bytes, as ``socket.recv`` (TorchServe's own readers call it)."""
        self._fill(1)
        return self._take(min(length, len(self._buffer) - self._at))

    def _requests(self) -> list[dict]:
        requests = []
        while (request_id := self._string()) is not None:
            headers = []
            while (name := self._string()) is not None:
                headers.append({"name": name, "value": self._take(self._length())})
            parameters = []
            while (parameter := self._string()) is not None:
                content_type = self._take(self._length()).decode("utf-8")
                parameters.append(
                    {"name": parameter.decode("utf-8"), "contentType": content_type, "value": self._take(self._length())}
                )
            requests.append({"requestId": request_id, "headers": headers, "parameters": parameters})
        return requests

    def _string(self) -> bytearray | None:
        """A length and that many bytes; None for the -1 that ends a list."""
        length = self._length()
        return None if length == -1 else self._take(length)

    def _length(self) -> int:
        if self._at + 4 > len(self._buffer):
            self._fill(4)
        at = self._at
        self._at = at + 4
        return _LENGTH.unpack_from(self._buffer, at)[0]

    def _take(self, length: int) -> bytearray:
        if self._at + length > len(self._buffer):
            self._fill(length)
        at = self._at
        self._at = at + length
        return self._buffer[at : at + length]

    def _fill(self, length: int) -> None:
        """At least ``length`` unread bytes in the buffer (a frontend that hung up ends the
        worker, as TorchServe's reader does)."""
        buffer = self._buffer
        del buffer[: self._at]  # from the front of a bytearray: no copy
        self._at = 0
        while len(buffer) < length:
            chunk = self.connection.recv(max(CHUNK_BYTES, length - len(buffer)))
            if not chunk:
                logger.info("Frontend disconnected.")
                sys.exit(0)
            buffer += chunk


def read_frames_buffered() -> str | None:
    """Makes the running worker read its socket through a ``FrameReader`` from its next message
    on; None when done, else why not (the worker goes on with TorchServe's reader)."""
    if os.environ.get("TS_DECODE_INPUT_REQUEST") != "false":
        return "TorchServe decodes request bodies here (decode_input_request is not false)"
    worker = _worker_module()
    if worker is None:
        return "TorchServe's worker loop (ts/model_service_worker.py) is not running in this process"
    readers: dict[Any, FrameReader] = {}

    def retrieve_msg(connection: Any) -> tuple[bytearray, Any]:
        reader = readers.get(connection)
        if reader is None:
            reader = readers[connection] = FrameReader(connection)
        return reader.message()

    worker.retrieve_msg = retrieve_msg
    return None


def _worker_module() -> Any:
    """The module whose ``TorchModelServiceWorker`` loop is reading with TorchServe's reader."""
    stock: Callable = otf_message_handler.retrieve_msg
    for module in (sys.modules.get("__main__"), sys.modules.get("ts.model_service_worker")):
        if getattr(module, "retrieve_msg", None) is stock and hasattr(module, "TorchModelServiceWorker"):
            return module
    return None
