"""AbortAnswers: which frames answer a receiver's ABORT, and which ABORT_ACK belongs to an earlier attempt."""

from __future__ import annotations

from aioembed.protocol.messages import AbortAck, Reject, Status, TransferStatus
from aioembed.session.abort_answers import AbortAnswers


def _status(room: str, *, fence: bool) -> Status:
    return Status(room=room, state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0, error="x",
                  fence=fence)


def test_an_abort_ack_or_a_fence_status_answers_an_abort_a_reject_or_plain_status_does_not() -> None:
    a = AbortAnswers()
    a.sent("r")
    a.late(Reject(reason="RESUME for a room it ended", room="r"), "r")
    a.late(_status("r", fence=False), "r")
    assert "r" in a and len(a) == 1
    a.late(AbortAck(room="r"), "r")
    assert "r" not in a and len(a) == 0
    a.sent("f")
    a.late(_status("f", fence=True), "f")
    assert "f" not in a


def test_an_abort_ack_is_stale_only_after_a_fence_status_answered_the_abort() -> None:
    a = AbortAnswers()
    assert not a.stale_ack("r")
    a.sent("r")
    a.late(AbortAck(room="r"), "r")
    assert not a.stale_ack("r")  # answered by its ABORT_ACK: nothing more follows
    a.late(_status("q", fence=True), "q")  # a fence STATUS of a room we did not abort
    assert not a.stale_ack("q")
    a.sent("f")
    a.late(_status("f", fence=True), "f")
    assert a.stale_ack("f") and not a.stale_ack("f")  # once


def test_the_rooms_remembered_after_a_fence_status_are_bounded() -> None:
    a = AbortAnswers(kept=3)
    for room in ["a", "b", "c", "d"]:
        a.sent(room)
        a.late(_status(room, fence=True), room)
    assert not a.stale_ack("a") and all(a.stale_ack(r) for r in ["b", "c", "d"])


def test_a_session_end_answers_every_abort() -> None:
    a = AbortAnswers()
    a.sent("r")
    a.sent(("p", 1))
    a.session_ended()
    assert len(a) == 0 and "r" not in a and ("p", 1) not in a
