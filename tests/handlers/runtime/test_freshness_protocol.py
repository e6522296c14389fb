"""The freshness protocol: calls parsed into types with every problem named, the one mapping from
errors to status codes, the mailbox's claims (each call answered once, whichever worker takes it),
and the Java plugin's side spelled as the Python side."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from archive_tools.plugin import SOURCES
from handlers.runtime import archive_files
from handlers.runtime.errors import Conflict
from handlers.runtime.freshness import protocol
from handlers.runtime.freshness.delta_file import DeltaError
from handlers.runtime.freshness.protocol import (
    PROTOCOL,
    Check,
    Checked,
    Mailbox,
    Rollback,
    RollbackAsked,
    State,
    parse_call,
    reply_bytes,
)


def _raw(**call) -> bytes:
    return orjson.dumps({"protocol": PROTOCOL, **call})


def test_calls_parse_into_their_types():
    assert parse_call(_raw(op="check", delta="/d/x.delta")) == Check(Path("/d/x.delta"))
    assert parse_call(_raw(op="rollback", to=3)) == Rollback(3)
    assert parse_call(_raw(op="state")) == State()


@pytest.mark.parametrize(
    "raw, field",
    [
        (b"{not json", "call"),
        (b"[1]", "call"),
        (orjson.dumps({"op": "state"}), "protocol"),
        (orjson.dumps({"protocol": 2, "op": "state"}), "protocol"),
        (_raw(op="publish"), "op"),
        (_raw(op="check"), "delta"),
        (_raw(op="rollback", to="latest"), "to"),
        (_raw(op="rollback", to=True), "to"),
    ],
)
def test_a_bad_call_is_a_400_naming_the_field(raw, field):
    reply = orjson.loads(reply_bytes(raw, lambda call: pytest.fail("a bad call must not be answered")))
    assert reply["protocol"] == PROTOCOL and reply["status"] == 400
    assert reply["error"]["field"] == field and reply["error"]["type"] == "BadRequest"


@pytest.mark.parametrize(
    "error, status, kind",
    [
        (Conflict("a rollback to 2 is under way", "delta"), 409, "Conflict"),
        (DeltaError("delta.sequence", "must be 4"), 400, "DeltaError"),
        (OSError(28, "No space left on device"), 500, "InternalError"),
    ],
)
def test_errors_become_status_codes_in_one_place(error, status, kind):
    def answer(call):
        raise error

    reply = orjson.loads(reply_bytes(_raw(op="state"), answer))
    assert reply["status"] == status and reply["error"]["code"] == status and reply["error"]["type"] == kind
    assert "reply" not in reply


def test_replies_carry_their_fields():
    checked = orjson.loads(reply_bytes(_raw(op="check", delta="/x"), lambda call: Checked(4, 100, False, "tiny")))
    assert checked == {"protocol": 1, "status": 200,
                       "reply": {"sequence": 4, "rows": 100, "duplicate": False, "model": "tiny"}}
    asked = orjson.loads(reply_bytes(_raw(op="rollback", to=1), lambda call: RollbackAsked(call.to, 5)))
    assert asked["reply"] == {"rolling_back_to": 1, "from": 5}


def test_each_call_in_the_mailbox_is_answered_once_by_whichever_worker_claims_it(tmp_path):
    box = tmp_path / archive_files.MAILBOX
    box.mkdir()
    for k in range(3):
        (box / f"{k}{protocol.CALL}").write_bytes(_raw(op="rollback", to=k))
    (box / f"9{protocol.CALL}.partial").write_bytes(b"half written")  # not a call yet
    first, second = Mailbox(tmp_path), Mailbox(tmp_path)
    asked: list[int] = []

    def answer(call):
        asked.append(call.to)
        if len(asked) == 1:  # meanwhile another worker takes what is left
            assert second.answer_waiting(answer) == 2
        return RollbackAsked(call.to, 9)

    assert first.answer_waiting(answer) == 1
    assert sorted(asked) == [0, 1, 2]
    replies = {p.name: orjson.loads(p.read_bytes()) for p in box.glob(f"*{protocol.REPLY}")}
    assert {name: r["reply"]["rolling_back_to"] for name, r in replies.items()} == {"0.reply": 0, "1.reply": 1, "2.reply": 2}
    assert sorted(p.name for p in box.iterdir()) == ["0.reply", "1.reply", "2.reply", "9.call.partial"]


def test_a_refusal_is_left_for_the_plugin(tmp_path):
    Mailbox(tmp_path).refuse("an exported archive cannot take deltas")
    assert orjson.loads((tmp_path / archive_files.MAILBOX / archive_files.REFUSED).read_bytes()) == {
        "message": "an exported archive cannot take deltas"
    }


def test_the_java_plugin_speaks_the_same_protocol():
    java = (SOURCES / "org" / "torchrecserve" / "plugin" / "FreshnessCalls.java").read_text()
    assert re.search(r"static final int PROTOCOL = (\d+);", java).group(1) == str(PROTOCOL)
    names = dict(re.findall(r'static final String (\w+) = "([^"]+)";', java))
    assert names == {"CALL": protocol.CALL, "REPLY": protocol.REPLY}
    assert '"op", "check", "delta"' in java and '"op", "rollback", "to"' in java and '"op", "state"' in java


def test_a_reply_that_cannot_be_written_is_logged_and_the_next_call_answered(tmp_path, monkeypatch, caplog):
    box = tmp_path / archive_files.MAILBOX
    box.mkdir()
    for k in range(2):
        (box / f"{k}{protocol.CALL}").write_bytes(_raw(op="rollback", to=k))
    written = protocol.write_whole

    def full_once(path, data):
        monkeypatch.setattr(protocol, "write_whole", written)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(protocol, "write_whole", full_once)
    assert Mailbox(tmp_path).answer_waiting(lambda call: RollbackAsked(call.to, 9)) == 1
    assert "could not answer the freshness call 0.call" in caplog.text
    assert sorted(p.name for p in box.iterdir()) == ["0.claimed", "1.reply"]  # the plugin times 0 out
