"""RoomIdHolds: which frames answer a receiver's ABORT, and when a barrier PONG lets an ended room's id go."""

from __future__ import annotations

from aioembed.protocol.messages import AbortAck, Reject, Status, TransferStatus
from aioembed.session.room_id_holds import RoomIdHolds


def _status(room: str, *, fence: bool) -> Status:
    return Status(room=room, state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0, error="x",
                  fence=fence)


def test_an_abort_ack_or_a_fence_status_answers_an_abort_a_reject_or_plain_status_does_not() -> None:
    h = RoomIdHolds()
    h.abort_sent("r", 0.0)
    assert not h.late(Reject(reason="RESUME for a room it ended", room="r"), "r")
    assert not h.late(_status("r", fence=False), "r")
    assert h.owes_answer("r") and "r" in h and len(h) == 1
    assert h.late(AbortAck(room="r"), "r")
    assert not h.owes_answer("r") and "r" not in h and len(h) == 0
    assert not h.late(AbortAck(room="r"), "r")  # a second answer answers nothing
    h.abort_sent("f", 0.0)
    assert h.late(_status("f", fence=True), "f") and "f" not in h


def test_a_barrier_holds_the_id_until_its_own_pong() -> None:
    h = RoomIdHolds()
    a, b = h.ended("a"), h.ended("b")
    assert a != b and "a" in h and "b" in h and not h.owes_answer("a")
    assert not h.pong(a + 1000)  # a heartbeat's PONG, or a stranger's nonce
    assert h.pong(b) and "a" in h and "b" not in h
    assert h.pong(a) and len(h) == 0
    assert not h.pong(a)


def test_an_id_is_held_until_both_its_abort_is_answered_and_its_barrier_came_back() -> None:
    h = RoomIdHolds()
    h.abort_sent("r", 0.0)
    nonce = h.ended("r")
    assert h.counts() == {"abort_unanswered": 1, "barrier": 0}  # an id counts once, under its refusal
    assert h.pong(nonce) and "r" in h  # the ABORT is still unanswered
    assert h.counts() == {"abort_unanswered": 1, "barrier": 0}
    assert h.late(AbortAck(room="r"), "r") and "r" not in h
    assert h.counts() == {"abort_unanswered": 0, "barrier": 0}
    h.abort_sent(("p", 1), 0.0)
    nonce = h.ended(("p", 1))
    assert h.late(_status("p", fence=True), ("p", 1)) and ("p", 1) in h  # the barrier stands
    assert h.counts() == {"abort_unanswered": 0, "barrier": 1}
    assert h.pong(nonce) and len(h) == 0


def test_a_new_end_of_the_same_id_waits_for_its_new_barrier() -> None:
    h = RoomIdHolds()
    first = h.ended("r")
    second = h.ended("r")
    assert not h.pong(first) and "r" in h
    assert h.pong(second) and "r" not in h


def test_a_session_end_releases_every_id() -> None:
    h = RoomIdHolds()
    h.abort_sent("r", 0.0)
    h.ended(("p", 1))
    h.session_ended()
    assert len(h) == 0 and "r" not in h and ("p", 1) not in h


def test_an_abort_unanswered_too_long_is_reported_once() -> None:
    h = RoomIdHolds()
    h.abort_sent("r", 10.0)
    h.abort_sent("q", 12.0)
    assert h.overdue(14.0, after=5.0) == []
    assert h.overdue(15.5, after=5.0) == ["r"]
    assert h.overdue(20.0, after=5.0) == ["q"]  # r told already
    assert h.late(AbortAck(room="r"), "r")
    h.abort_sent("r", 30.0)  # the id aborted again later: reported again if that ABORT is not answered
    assert h.overdue(40.0, after=5.0) == ["r"]
