"""The freshness protocol between the plugin and a model's workers: typed calls and replies, the
one place where a refusal becomes a status code, and the mailbox they travel through.

Calls go through files in the model's folder (``freshness-calls/``), off the inference path and
out of reach of inference clients: the plugin writes ``<id>.call`` whole (by a rename); one of
the model's workers claims it (renaming it to ``<id>.claimed``), writes ``<id>.reply`` whole, and
removes its claim. A worker whose archive takes no deltas writes ``refused.json`` at load
instead (when the plugin registered the model and named its delta log), which the plugin answers
with a 409. The plugin's side is ``FreshnessCalls.java``; a
test checks that both spell the names and the protocol version alike.

    {"protocol": 1, "op": "check", "delta": "/store/deltas/m-00000003.delta"}  -> Checked
    {"protocol": 1, "op": "rollback", "to": 2}                                 -> RollbackAsked
    {"protocol": 1, "op": "state"}                                             -> the State's fields
    reply: {"protocol": 1, "status": 200, "reply": {...}}
       or  {"protocol": 1, "status": 409, "error": {"code": 409, "type": "Conflict", "message": ...}}
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Callable, Union

import orjson

from handlers.runtime.archive_files import MAILBOX, REFUSED
from handlers.runtime.errors import BadRequest, InternalError, ServingError

logger = logging.getLogger(__name__)

PROTOCOL = 1
CALL, CLAIMED, REPLY = ".call", ".claimed", ".reply"


@dataclasses.dataclass(frozen=True)
class Check:
    """Is the delta file the log's next (or a duplicate of one in it), and whole?"""

    delta: Path


@dataclasses.dataclass(frozen=True)
class Rollback:
    """The tables as they were after delta ``to`` (0: the archive's own rows)."""

    to: int


@dataclasses.dataclass(frozen=True)
class State:
    """The applied sequence, the log's head, rows applied and the workers' notes."""


Call = Union[Check, Rollback, State]


class Reply:
    """A call's answer, as the JSON the plugin reads."""

    def to_reply(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


@dataclasses.dataclass(frozen=True)
class Checked(Reply):
    sequence: int
    rows: int
    duplicate: bool
    model: str


@dataclasses.dataclass(frozen=True)
class RollbackAsked(Reply):
    to: int
    head: int

    def to_reply(self) -> dict[str, Any]:
        return {"rolling_back_to": self.to, "from": self.head}


@dataclasses.dataclass(frozen=True)
class FreshnessState(Reply):
    """``tables_file``: the working copy the deltas change; ``workers``: each live worker's note
    (pid, the delta whose dense weights it serves, whether its tables are pinned)."""

    base: str
    tables_file: str
    applied_sequence: int
    log_head: int
    rolling_back_to: int | None
    rows_applied: int
    updated_at: float | None
    error: str | None
    workers: list[dict[str, Any]]


def parse_call(raw: bytes) -> Call:
    """A call's bytes -> its type; what is wrong is a 400 naming the field."""
    try:
        call = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest("call", f"not JSON: {e}") from None
    if not isinstance(call, dict):
        raise BadRequest("call", "must be a JSON object")
    if call.get("protocol") != PROTOCOL:
        raise BadRequest("protocol", f"this worker speaks {PROTOCOL}, the call {call.get('protocol')!r}")
    op = call.get("op")
    if op == "check" and isinstance(call.get("delta"), str):
        return Check(Path(call["delta"]))
    if op == "rollback" and isinstance(call.get("to"), int) and not isinstance(call.get("to"), bool):
        return Rollback(call["to"])
    if op == "state":
        return State()
    if op not in ("check", "rollback", "state"):
        raise BadRequest("op", f"must be check, rollback or state, got {op!r}")
    raise BadRequest("delta" if op == "check" else "to", f"missing or of the wrong type in a {op} call")


def reply_bytes(raw: bytes, answer: Callable[[Call], Reply]) -> bytes:
    """The reply to the call ``raw``, answered by ``answer``: the one place where an error becomes
    a status code (a ``ServingError`` its own; anything else a logged 500)."""
    try:
        reply = answer(parse_call(raw)).to_reply()
        return orjson.dumps({"protocol": PROTOCOL, "status": 200, "reply": reply})
    except ServingError as error:
        return orjson.dumps({"protocol": PROTOCOL, "status": error.status, "error": error.to_body()})
    except Exception as e:  # a bug, or the file system: the call fails, the worker serves on
        logger.exception("freshness call failed")
        error = InternalError(f"the freshness call failed: {type(e).__name__}: {e}")
        return orjson.dumps({"protocol": PROTOCOL, "status": error.status, "error": error.to_body()})


class Mailbox:
    """A model's freshness calls, as one of its workers sees them."""

    def __init__(self, model_dir: Path) -> None:
        self.folder = Path(model_dir) / MAILBOX

    def refuse(self, why: str) -> None:
        """Every call is answered 409 with ``why``: the model's archive takes no deltas."""
        self.folder.mkdir(exist_ok=True)
        write_whole(self.folder / REFUSED, orjson.dumps({"message": why}))

    def accept(self) -> None:
        """This worker answers calls: an earlier refusal (a copy that could not be made then) goes."""
        self.folder.mkdir(exist_ok=True)
        (self.folder / REFUSED).unlink(missing_ok=True)

    def answer_waiting(self, answer: Callable[[Call], Reply]) -> int:
        """Claims the calls waiting (another worker may claim one first) and replies to each;
        how many this worker answered."""
        answered = 0
        for call in sorted(self.folder.glob(f"*{CALL}")):
            claimed = call.with_suffix(CLAIMED)
            try:
                os.rename(call, claimed)
            except FileNotFoundError:
                continue  # another worker's now
            try:
                write_whole(call.with_suffix(REPLY), reply_bytes(claimed.read_bytes(), answer))
                claimed.unlink()
            except OSError:  # the plugin times the call out; this worker goes on serving and answering
                logger.exception("could not answer the freshness call %s", call.name)
                continue
            answered += 1
        return answered


def write_whole(path: Path, data: bytes) -> None:
    """``data`` at ``path``, whole: a reader sees the file complete or not at all."""
    staged = path.with_name(path.name + ".partial")
    staged.write_bytes(data)
    os.replace(staged, path)
