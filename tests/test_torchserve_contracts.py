"""What the plugin relies on in TorchServe beyond its serving SDK (``Internals.java``,
``Contract.java``): checked on the installed TorchServe by the plugin's own check, run here, and
the one behaviour no name can pin (how ``Model.pollBatch`` starts a batch), read from its bytecode.
And what the handler relies on in TorchServe's Python worker (``handlers/torchserve_internals.py``):
its message frames and the loop that reads them. A TorchServe upgrade that changes one fails here
by name."""

from __future__ import annotations

import inspect
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading

import pytest
from ts.protocol import otf_message_handler

from archive_tools import plugin
from archive_tools.plugin import JAR_NAME, PluginBuildError, built_for, plugin_dir, serving_sdk_jar
from handlers.torchserve_internals import FramedRequest, FrameReader, inference_message, read_frames_buffered

CONTRACT = "org.torchrecserve.plugin.Contract"


def _java(*args: str) -> subprocess.CompletedProcess:
    classpath = f"{serving_sdk_jar()}:{plugin_dir() / JAR_NAME}"
    return subprocess.run(["java", "-cp", classpath, CONTRACT, *args], capture_output=True, text=True, timeout=60)


def test_the_installed_torchserve_has_what_the_plugin_reaches_into():
    """Model.jobsDb, WorkerThread.req/aggregator/running/currentThread, BatchAggregator.jobs,
    Model.DEFAULT_DATA_QUEUE's value: looked up as the plugin does when TorchServe loads it."""
    done = _java()
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "ok", done.stdout + done.stderr


def test_another_torchserve_version_is_refused_naming_both():
    done = _java("0.13.0")
    assert done.returncode == 1
    assert done.stdout.strip().splitlines()[-1].startswith(
        f"torchrec-serve plugin: built for TorchServe {built_for()}, this server runs 0.13.0"
    )


def test_the_plugin_is_not_built_against_another_torchserve(monkeypatch):
    monkeypatch.setattr(plugin, "installed_torchserve", lambda: "0.13.0")
    with pytest.raises(PluginBuildError, match=rf"written for TorchServe {built_for()}, and TorchServe 0.13.0"):
        plugin_dir()


def test_a_batch_starts_with_a_poll_of_long_max_value():
    """AdmissionQueue knows a batch starts when a worker polls with Long.MAX_VALUE: Model.pollBatch's
    first take (its later takes wait maxBatchDelay, an int of milliseconds)."""
    javap = shutil.which("javap")
    assert javap, "javap (from the JDK that compiles the plugin) reads TorchServe's bytecode"
    done = subprocess.run([javap, "-c", "-p", "-classpath", str(serving_sdk_jar()), "org.pytorch.serve.wlm.Model"],
                          capture_output=True, text=True, check=True)
    body = done.stdout.split("pollBatch(")[1].split("\n\n")[0]
    locked = body.index("lockInterruptibly")  # the model's lock: then the data queue's first take
    first_take = body.index("LinkedBlockingDeque.poll:(JLjava/util/concurrent/TimeUnit;)", locked)
    assert re.search(r"ldc2_w .*long 9223372036854775807l", body[locked:first_take]), body[locked:first_take]


# --- the worker's reader (handlers/torchserve_internals.py) ---


def _string(value: bytes) -> bytes:
    return struct.pack("!i", len(value)) + value


_HEADERS = {b"Host": b"127.0.0.1:8080", b"Content-Type": b"application/json", b"Authorization": b"Bearer x"}
_MESSAGES = [
    # a REST batch: a small body, an empty one, one far larger than a read of the socket
    inference_message([
        FramedRequest(b"r-1", _HEADERS, [(b"body", b"application/json", b'{"items": []}')]),
        FramedRequest(b"r-2", {}, [(b"body", b"application/json", b"")]),
        FramedRequest(b"r-3", _HEADERS, [(b"body", b"application/octet-stream", bytes(range(256)) * 1000)]),
    ]),
    # a form's fields and a gRPC request's inputs come as several parameters; a describe call
    inference_message([
        FramedRequest(b"g-1", {b"describe": b"True"}, [(b"data", b"", b"\x00\x01"), (b"x", b"text/plain", b"\xc3\xa9")])
    ]),
    # a model load, read by TorchServe's own reader from the same buffer
    b"L" + _string(b"criteo") + _string(b"/tmp/model") + struct.pack("!i", 32) + _string(b"handler.py")
    + struct.pack("!i", -1) + _string(b"") + struct.pack("!?", False),
    inference_message([]),  # an empty batch
]


def _read_all(read) -> list:
    """Every message of ``_MESSAGES``, sent back to back over a socket, as ``read(socket)`` reads them."""
    ours, theirs = socket.socketpair()
    sender = threading.Thread(target=lambda: (theirs.sendall(b"".join(_MESSAGES)), theirs.close()))
    sender.start()
    try:
        return [read(ours) for _ in _MESSAGES]
    finally:
        sender.join()
        ours.close()


def test_the_buffered_reader_reads_what_torchserves_reader_reads(monkeypatch):
    """Same commands, requests, headers, parameters and types (bytearray, str) as
    ``otf_message_handler.retrieve_msg`` with undecoded bodies, message after message from one buffer."""
    monkeypatch.setenv("TS_DECODE_INPUT_REQUEST", "false")
    stock = _read_all(otf_message_handler.retrieve_msg)
    readers: dict = {}
    buffered = _read_all(lambda s: readers.setdefault(s, FrameReader(s)).message())

    def typed(value):
        if isinstance(value, dict):
            return {k: typed(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [typed(v) for v in value]
        return type(value).__name__, value

    assert typed(buffered) == typed(stock)
    assert [len(m) for _, m in stock[:2]] == [3, 1] and stock[2][1]["batchSize"] == 32  # read, not empty


def test_a_frontend_that_hangs_up_ends_the_worker_as_torchserve_does():
    ours, theirs = socket.socketpair()
    theirs.sendall(b"I" + _string(b"r-1")[:3])
    theirs.close()
    with pytest.raises(SystemExit) as exited:
        FrameReader(ours).message()
    assert exited.value.code == 0
    ours.close()


def test_the_worker_loop_reads_each_message_through_its_module_global(monkeypatch):
    """``handle_connection`` calls the ``retrieve_msg`` of its module's globals per message, which
    ``read_frames_buffered`` replaces; without ``decode_input_request=false`` it keeps TorchServe's."""
    from ts import model_service_worker

    loop = inspect.getsource(model_service_worker.TorchModelServiceWorker.handle_connection)
    assert "cmd, msg = retrieve_msg(cl_socket)" in loop
    assert model_service_worker.retrieve_msg is otf_message_handler.retrieve_msg
    monkeypatch.setattr(model_service_worker, "retrieve_msg", otf_message_handler.retrieve_msg)
    monkeypatch.delenv("TS_DECODE_INPUT_REQUEST", raising=False)
    assert "decode_input_request" in read_frames_buffered()
    assert model_service_worker.retrieve_msg is otf_message_handler.retrieve_msg
    monkeypatch.setenv("TS_DECODE_INPUT_REQUEST", "false")
    assert read_frames_buffered() is None
    assert model_service_worker.retrieve_msg is not otf_message_handler.retrieve_msg


def test_a_message_of_an_unknown_command_is_refused_as_torchserve_refuses_it():
    ours, theirs = socket.socketpair()
    theirs.sendall(b"X" + inference_message([])[1:])
    with pytest.raises(ValueError, match="Invalid command"):
        FrameReader(ours).message()
    ours.close()
    theirs.close()


def test_outside_a_torchserve_worker_the_reader_is_left_alone_and_says_why(monkeypatch):
    """In a process that runs no worker loop (here: pytest), nothing is replaced."""
    monkeypatch.setenv("TS_DECODE_INPUT_REQUEST", "false")
    monkeypatch.delitem(sys.modules, "ts.model_service_worker", raising=False)
    assert "worker loop" in read_frames_buffered()
