"""The per-room state machines: every transition, every illegal event, and both sides driven
against each other through the codec with real bytes moved into a block pool."""

from __future__ import annotations

import copy
import ctypes
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aioembed import BlockPool, Field, Layout
from aioembed.errors import ProtocolError
from aioembed.memory.plan import FieldSpan, plan_row_runs, plan_writes
from aioembed.protocol.messages import Init, Progress, Resume, Status, Total, decode, encode
from aioembed.protocol.room import Arrived, RankPhase, ReceiverRoomState, SenderRoomState, TransferStatus, WriteTask

TS = TransferStatus
BS = 4


def snapshot(obj: Any) -> dict[str, Any]:
    return copy.deepcopy(vars(obj))


def assert_illegal(obj: Any, call: Callable[[], Any], *, room: Any, state: str | None = None,
                   match: str | None = None) -> ProtocolError:
    """``call`` raises ProtocolError naming the room (and state), and changes nothing."""
    before = snapshot(obj)
    state_before = obj.state
    with pytest.raises(ProtocolError) as info:
        call()
    err = info.value
    assert err.room == room
    assert repr(room) in str(err)
    if state is not None:
        assert state in str(err), f"error does not name state {state}: {err}"
    if match is not None:
        assert re.search(match, str(err)), str(err)
    assert snapshot(obj) == before
    assert obj.state is state_before
    return err


def status(room: Any = "r", *, state: str = "TRANSFERRING", total: int = 20, sent: int = 8, rnd: int = 0,
           metadata: dict[str, Any] | None = None, error: str | None = None) -> Status:
    return Status(room=room, state=state, total_tokens=total, sent_tokens=sent, round=rnd, metadata=metadata,
                  error=error)


# -- receiver: fixtures in every state --------------------------------------------------------


def r_boot() -> ReceiverRoomState:
    return ReceiverRoomState("r", block_size=BS, max_tokens=1000)


def r_waiting() -> ReceiverRoomState:
    r = r_boot()
    r.init_sent(blocks=2, allocated_tokens=8)
    return r


def r_transferring() -> ReceiverRoomState:
    """Round 0 done: 8 of 20 tokens arrived, no reservation outstanding."""
    r = r_waiting()
    r.on_status(status())
    return r


def r_resumed() -> ReceiverRoomState:
    """Round 1 reserved (8 tokens), STATUS awaited."""
    r = r_transferring()
    r.resume_sent(blocks=2, allocated_tokens=8)
    return r


def r_success() -> ReceiverRoomState:
    r = r_waiting()
    r.on_status(status(state="SUCCESS", total=5, sent=5))
    return r


def r_failed() -> ReceiverRoomState:
    r = r_waiting()
    r.fail("x")
    return r


def r_aborted() -> ReceiverRoomState:
    r = r_waiting()
    r.abort("x")
    return r


RECEIVER_STATES: dict[str, Callable[[], ReceiverRoomState]] = {
    "boot": r_boot, "waiting": r_waiting, "transferring": r_transferring, "resumed": r_resumed,
    "success": r_success, "failed": r_failed, "aborted": r_aborted,
}


def test_receiver_fixture_states() -> None:
    expected = {"boot": TS.BOOTSTRAPPING, "waiting": TS.WAITING_FOR_INPUT, "transferring": TS.TRANSFERRING,
                "resumed": TS.TRANSFERRING, "success": TS.SUCCESS, "failed": TS.FAILED, "aborted": TS.ABORTED}
    for name, make in RECEIVER_STATES.items():
        assert make().state is expected[name], name


def test_terminal_property() -> None:
    assert {s for s in TS if s.terminal} == {TS.SUCCESS, TS.FAILED, TS.ABORTED}


# -- receiver: legal transitions --------------------------------------------------------------


def test_receiver_init() -> None:
    r = r_boot()
    assert (r.state, r.round, r.received, r.total, r.allocated) == (TS.BOOTSTRAPPING, 0, 0, None, 0)
    r.init_sent(blocks=3, allocated_tokens=9)
    assert (r.state, r.round, r.allocated) == (TS.WAITING_FOR_INPUT, 0, 9)


def test_receiver_single_round_success() -> None:
    r = r_waiting()
    got = r.on_status(status(state="SUCCESS", total=6, sent=6, metadata={"m": 1}))
    assert got == Arrived(start=0, count=6, total=6, complete=True, metadata={"m": 1})
    assert got.remaining == 0
    assert (r.state, r.received, r.total) == (TS.SUCCESS, 6, 6)


def test_receiver_exact_fit_success() -> None:
    r = r_waiting()
    got = r.on_status(status(state="SUCCESS", total=8, sent=8))
    assert got is not None and got.count == 8 and got.complete


def test_receiver_resume_rounds() -> None:
    r = r_waiting()
    a0 = r.on_status(status(total=20, sent=8))
    assert a0 == Arrived(start=0, count=8, total=20, complete=False, metadata=None)
    assert a0.remaining == 12
    assert (r.state, r.received, r.total, r.round) == (TS.TRANSFERRING, 8, 20, 0)
    r.resume_sent(blocks=2, allocated_tokens=8)
    assert (r.state, r.round, r.allocated) == (TS.TRANSFERRING, 1, 8)
    a1 = r.on_status(status(total=20, sent=16, rnd=1))
    assert a1 == Arrived(start=8, count=8, total=20, complete=False, metadata=None)
    r.resume_sent(blocks=1, allocated_tokens=4)
    a2 = r.on_status(status(state="SUCCESS", total=20, sent=20, rnd=2, metadata={"k": "v"}))
    assert a2 == Arrived(start=16, count=4, total=20, complete=True, metadata={"k": "v"})
    assert (r.state, r.received, r.round) == (TS.SUCCESS, 20, 2)


@pytest.mark.parametrize("make", ["boot", "waiting", "transferring", "resumed"])
@pytest.mark.parametrize(("peer_state", "final"), [("FAILED", TS.FAILED), ("ABORTED", TS.ABORTED)])
def test_receiver_peer_failure_from_any_live_state(make: str, peer_state: str, final: TS) -> None:
    r = RECEIVER_STATES[make]()
    rnd = r.round
    assert r.on_status(status(state=peer_state, total=0, sent=0, rnd=99, error="disk on fire")) is None
    assert r.state is final
    assert r.error == "disk on fire"
    assert r.round == rnd
    r2 = RECEIVER_STATES[make]()
    r2.on_status(status(state=peer_state, total=0, sent=0))
    assert r2.error and peer_state in r2.error


@pytest.mark.parametrize("make", ["boot", "waiting", "transferring", "resumed"])
def test_receiver_local_fail_and_abort(make: str) -> None:
    r = RECEIVER_STATES[make]()
    r.fail("timeout")
    assert (r.state, r.error) == (TS.FAILED, "timeout")
    r2 = RECEIVER_STATES[make]()
    r2.abort("cancelled")
    assert (r2.state, r2.error) == (TS.ABORTED, "cancelled")


@pytest.mark.parametrize("make", ["success", "failed", "aborted"])
def test_receiver_fail_abort_noop_when_terminal(make: str) -> None:
    r = RECEIVER_STATES[make]()
    before = snapshot(r)
    r.fail("late")
    r.abort("late")
    assert snapshot(r) == before


# -- receiver: illegal events -----------------------------------------------------------------


@pytest.mark.parametrize("make", ["waiting", "transferring", "resumed", "success", "failed", "aborted"])
def test_receiver_duplicate_init(make: str) -> None:
    r = RECEIVER_STATES[make]()
    assert_illegal(r, lambda: r.init_sent(blocks=1, allocated_tokens=4), room="r", state=r.state.name,
                   match="INIT")


@pytest.mark.parametrize(("blocks", "tokens"), [(0, 0), (1, 0), (1, 5), (2, 4), (3, 8), (0, 1), (2, 100)])
def test_receiver_init_reservation_must_fit(blocks: int, tokens: int) -> None:
    r = r_boot()
    assert_illegal(r, lambda: r.init_sent(blocks=blocks, allocated_tokens=tokens), room="r")


@pytest.mark.parametrize("make", ["boot", "waiting", "success", "failed", "aborted"])
def test_receiver_resume_illegal_states(make: str) -> None:
    r = RECEIVER_STATES[make]()
    assert_illegal(r, lambda: r.resume_sent(blocks=1, allocated_tokens=4), room="r", state=r.state.name,
                   match="RESUME")


@pytest.mark.parametrize(("blocks", "tokens"), [(4, 13), (1, 0), (2, 4), (1, 5), (0, 0)])
def test_receiver_resume_bad_reservation(blocks: int, tokens: int) -> None:
    r = r_transferring()  # 12 tokens remain
    assert_illegal(r, lambda: r.resume_sent(blocks=blocks, allocated_tokens=tokens), room="r")


@pytest.mark.parametrize("make", ["success", "failed", "aborted"])
@pytest.mark.parametrize("peer_state", ["TRANSFERRING", "SUCCESS", "FAILED", "ABORTED"])
def test_receiver_status_after_end(make: str, peer_state: str) -> None:
    r = RECEIVER_STATES[make]()
    assert_illegal(r, lambda: r.on_status(status(state=peer_state, total=5, sent=5)), room="r",
                   state=r.state.name, match="STATUS")


@pytest.mark.parametrize("make", ["boot", "transferring"])
def test_receiver_status_without_reservation(make: str) -> None:
    r = RECEIVER_STATES[make]()
    assert_illegal(r, lambda: r.on_status(status(total=20, sent=16, rnd=r.round)), room="r",
                   state=r.state.name)


BAD_STATUS_WAITING = {
    "sender state BOOTSTRAPPING": status(state="BOOTSTRAPPING"),
    "sender state WAITING": status(state="WAITING_FOR_INPUT"),
    "round 1": status(rnd=1),
    "total 0": status(total=0, sent=0),
    "total over max": status(total=1001, sent=8),
    "too few": status(total=20, sent=7),
    "too many": status(total=20, sent=9),
    "SUCCESS partial": status(state="SUCCESS", total=20, sent=8),
    "TRANSFERRING complete": status(state="TRANSFERRING", total=8, sent=8),
    "SUCCESS short": status(state="SUCCESS", total=6, sent=5),
}

BAD_STATUS_RESUMED = {
    "round 0 again": status(total=20, sent=16, rnd=0),
    "round 2": status(total=20, sent=16, rnd=2),
    "total changed": status(total=21, sent=16, rnd=1),
    "no progress": status(total=20, sent=8, rnd=1),
    "went back": status(total=20, sent=4, rnd=1),
    "over reservation": status(total=20, sent=17, rnd=1),
    "SUCCESS partial": status(state="SUCCESS", total=20, sent=16, rnd=1),
}


@pytest.mark.parametrize("msg", BAD_STATUS_WAITING.values(), ids=BAD_STATUS_WAITING.keys())
def test_receiver_bad_status_round0(msg: Status) -> None:
    r = r_waiting()
    assert_illegal(r, lambda: r.on_status(msg), room="r")


@pytest.mark.parametrize("msg", BAD_STATUS_RESUMED.values(), ids=BAD_STATUS_RESUMED.keys())
def test_receiver_bad_status_round1(msg: Status) -> None:
    r = r_resumed()
    assert_illegal(r, lambda: r.on_status(msg), room="r")


@pytest.mark.parametrize(
    ("make", "call"),
    [
        ("waiting", lambda r: r.on_status(status(rnd=1))),
        ("waiting", lambda r: r.on_status(status(total=20, sent=9))),
        ("waiting", lambda r: r.on_status(status(total=1001))),
        ("resumed", lambda r: r.on_status(status(total=21, sent=16, rnd=1))),
        ("boot", lambda r: r.init_sent(blocks=1, allocated_tokens=5)),
        ("transferring", lambda r: r.resume_sent(blocks=4, allocated_tokens=13)),
    ],
)
def test_receiver_validation_errors_name_state(make: str, call: Callable[[ReceiverRoomState], Any]) -> None:
    r = RECEIVER_STATES[make]()
    assert_illegal(r, lambda: call(r), room="r", state=f"state {r.state.name}")


def test_int_room_ids_in_errors() -> None:
    r = ReceiverRoomState(-7, block_size=BS, max_tokens=10)
    assert_illegal(r, lambda: r.on_status(status(room=-7, total=5, sent=5)), room=-7, state="BOOTSTRAPPING")


# -- sender: legal transitions ----------------------------------------------------------------


def s_room(num_blocks: int | None = 64) -> SenderRoomState:
    return SenderRoomState("s", block_size=BS, num_blocks=num_blocks)


def test_sender_states_init_then_input() -> None:
    s = s_room()
    assert s.state is TS.BOOTSTRAPPING and s.ready_ranks() == []
    s.on_init(0, blocks=(5, 2), allocated_tokens=8, expected_ranks=2)
    assert s.state is TS.WAITING_FOR_INPUT
    assert s.ready_ranks() == []  # no input yet
    s.on_input(10)
    assert s.state is TS.TRANSFERRING
    assert s.ready_ranks() == [0]
    task = s.start_write(0)
    assert task == WriteTask(rank=0, round=0, start=0, count=8, blocks=(5, 2))
    assert s.writing(0) and not s.writing(1)
    st0 = s.write_done(task, metadata={"m": 1})
    # the metadata goes with the first announcement to the rank, and only then
    assert st0 == Status(room="s", state="TRANSFERRING", total_tokens=10, sent_tokens=8, round=0, metadata={"m": 1})
    assert s.ranks[0].phase is RankPhase.AWAITING_RESUME
    s.on_resume(0, round=1, sent_tokens=8, blocks=(7,), allocated_tokens=2)
    assert s.ranks[0].phase is RankPhase.READY
    t1 = s.start_write(0)
    assert t1 == WriteTask(rank=0, round=1, start=8, count=2, blocks=(7,))
    st1 = s.write_done(t1, metadata={"m": 1})
    assert st1 == Status(room="s", state="SUCCESS", total_tokens=10, sent_tokens=10, round=1)
    assert s.ranks[0].phase is RankPhase.DONE
    assert s.state is TS.TRANSFERRING  # rank 1 has not even sent INIT
    s.on_init(1, blocks=(1, 2, 3), allocated_tokens=12, expected_ranks=2)
    t = s.start_write(1)
    assert t.count == 10
    assert s.write_done(t).state == "SUCCESS"
    assert s.state is TS.SUCCESS
    s.fail("late")  # no-op after success
    assert s.state is TS.SUCCESS and s.error is None


def test_sender_input_before_init() -> None:
    s = s_room()
    s.on_input(3)
    assert s.state is TS.BOOTSTRAPPING
    assert s.ready_ranks() == []
    s.on_init(0, blocks=(9,), allocated_tokens=4, expected_ranks=1)
    assert s.state is TS.TRANSFERRING
    t = s.start_write(0)
    assert t.count == 3
    assert s.write_done(t).sent_tokens == 3
    assert s.state is TS.SUCCESS


@pytest.mark.parametrize("input_first", [True, False])
@pytest.mark.parametrize(("total", "fails"), [(8, False), (3, True), (9, True)])
def test_sender_part_of_exact_length(input_first: bool, total: int, fails: bool) -> None:
    """A part's INIT names its exact length: another input fails the room before any write, whichever came
    first; the right length goes as any room."""
    s = s_room()
    if input_first:
        s.on_input(total)
    s.on_init(0, blocks=(1, 2), allocated_tokens=8, expected_ranks=1, exact_tokens=8)
    if not input_first:
        s.on_input(total)
    if fails:
        assert s.state is TS.FAILED and s.ready_ranks() == []
        assert s.error is not None and f"gave {total} tokens" in s.error and "exactly 8 tokens" in s.error
    else:
        t = s.start_write(0)
        assert t.count == 8 and s.write_done(t).state == "SUCCESS"


@pytest.mark.parametrize("aborted", [False, True])
def test_sender_fail(aborted: bool) -> None:
    s = s_room()
    s.on_init(0, blocks=(1,), allocated_tokens=4, expected_ranks=1)
    s.on_input(9)
    s.fail("boom", aborted=aborted)
    assert s.state is (TS.ABORTED if aborted else TS.FAILED)
    assert s.error == "boom"
    assert s.ready_ranks() == []
    s.fail("second", aborted=not aborted)
    assert s.error == "boom" and s.state is (TS.ABORTED if aborted else TS.FAILED)


# -- sender: illegal events -------------------------------------------------------------------


def s_writing() -> tuple[SenderRoomState, WriteTask]:
    s = s_room()
    s.on_init(0, blocks=(1, 2), allocated_tokens=8, expected_ranks=2)
    s.on_input(20)
    return s, s.start_write(0)


def s_awaiting() -> SenderRoomState:
    s, t = s_writing()
    s.write_done(t)
    return s


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "expected_ranks": 2}, "outside"),
        ({"rank": -1, "expected_ranks": 2}, "outside"),
        ({"rank": 0, "expected_ranks": 0}, "expects 0 ranks"),
        ({"rank": 1, "expected_ranks": 3}, "expects 3 ranks"),
        ({"rank": 0, "expected_ranks": 2}, "duplicate INIT"),
        ({"rank": 1, "expected_ranks": 2, "blocks": (3, 3)}, "duplicate block"),
        ({"rank": 1, "expected_ranks": 2, "blocks": (3, 64)}, "outside"),
        ({"rank": 1, "expected_ranks": 2, "blocks": (3, 9), "num_blocks": 9}, "outside"),
        ({"rank": 1, "expected_ranks": 2, "allocated_tokens": 9}, "do not fit"),
        ({"rank": 1, "expected_ranks": 2, "allocated_tokens": 4}, "do not fit"),
        ({"rank": 1, "expected_ranks": 2, "allocated_tokens": 0}, "do not fit"),
        ({"rank": 1, "expected_ranks": 2, "blocks": ()}, "do not fit"),
    ],
)
def test_sender_bad_init(kwargs: dict[str, Any], match: str) -> None:
    s, _ = s_writing()
    args = {"blocks": (3, 4), "allocated_tokens": 8, **kwargs}
    rank = args.pop("rank")
    assert_illegal(s, lambda: s.on_init(rank, **args), room="s", state="TRANSFERRING", match=match)


def test_sender_block_limit_per_call_overrides_room() -> None:
    s = SenderRoomState("s", block_size=BS)  # no pool size known
    s.on_init(0, blocks=(1000,), allocated_tokens=4, expected_ranks=2)
    assert_illegal(s, lambda: s.on_init(1, blocks=(10,), allocated_tokens=4, expected_ranks=2, num_blocks=10),
                   room="s", match="outside")


def test_sender_events_after_failure() -> None:
    s = s_room()
    s.on_init(0, blocks=(1,), allocated_tokens=4, expected_ranks=2)
    s.fail("gone")
    assert_illegal(s, lambda: s.on_init(1, blocks=(2,), allocated_tokens=4, expected_ranks=2), room="s",
                   state="FAILED")
    assert_illegal(s, lambda: s.on_input(4), room="s", state="FAILED")
    assert_illegal(s, lambda: s.start_write(0), room="s", state="FAILED")


def test_sender_bad_input() -> None:
    s = s_room()
    for bad in (0, -3):
        assert_illegal(s, lambda bad=bad: s.on_input(bad), room="s", state="BOOTSTRAPPING")
    s.on_input(5)
    assert_illegal(s, lambda: s.on_input(5), room="s", match="already")


def test_sender_bad_start_write() -> None:
    s = s_room()
    s.on_init(0, blocks=(1,), allocated_tokens=4, expected_ranks=2)
    assert_illegal(s, lambda: s.start_write(0), room="s", state="WAITING_FOR_INPUT")  # no input
    s.on_input(8)
    assert_illegal(s, lambda: s.start_write(1), room="s")  # no INIT from rank 1
    t = s.start_write(0)
    assert_illegal(s, lambda: s.start_write(0), room="s")  # already writing
    s.write_done(t)
    assert_illegal(s, lambda: s.start_write(0), room="s")  # awaiting RESUME


def test_sender_bad_write_done() -> None:
    s, t = s_writing()
    assert_illegal(s, lambda: s.write_done(WriteTask(rank=1, round=0, start=0, count=8, blocks=(1, 2))),
                   room="s")
    assert_illegal(s, lambda: s.write_done(WriteTask(rank=0, round=1, start=0, count=8, blocks=(1, 2))),
                   room="s")
    s.write_done(t)
    assert_illegal(s, lambda: s.write_done(t), room="s")  # twice


RESUME_OK = {"round": 1, "sent_tokens": 8, "blocks": (5, 6), "allocated_tokens": 8}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"round": 0}, "round 0, expected round 1"),
        ({"round": 2}, "round 2, expected round 1"),
        ({"sent_tokens": 7}, "7 tokens arrived, 8 were sent"),
        ({"sent_tokens": 0}, "0 tokens arrived"),
        ({"sent_tokens": 16}, "16 tokens arrived"),
        ({"blocks": (5, 6, 7, 8), "allocated_tokens": 13}, "only 12 remain"),
        ({"blocks": (5, 6), "allocated_tokens": 9}, "do not fit"),
        ({"blocks": (5, 6, 7), "allocated_tokens": 8}, "do not fit"),
        ({"blocks": (5, 5)}, "duplicate"),
        ({"blocks": (5, 64)}, "outside"),
        ({"blocks": (), "allocated_tokens": 0}, "do not fit"),
    ],
)
def test_sender_bad_resume(changes: dict[str, Any], match: str) -> None:
    s = s_awaiting()
    kw = {**RESUME_OK, **changes}
    assert_illegal(s, lambda: s.on_resume(0, **kw), room="s", state="TRANSFERRING", match=match)
    s.on_resume(0, **RESUME_OK)  # the right one is still accepted afterwards
    assert s.ranks[0].phase is RankPhase.READY


def test_sender_resume_out_of_turn() -> None:
    s, t = s_writing()
    # while the round's write is in flight, a RESUME must start where that round will end (early)
    assert_illegal(s, lambda: s.on_resume(0, **{**RESUME_OK, "sent_tokens": 0}), room="s",
                   match="0 tokens arrived, 8 were sent once round 0 ends")
    assert_illegal(s, lambda: s.on_resume(1, **RESUME_OK), room="s", match="not expected")  # no INIT of rank 1
    s.write_done(t)
    s.on_resume(0, **RESUME_OK)
    # a second RESUME for the same round
    assert_illegal(s, lambda: s.on_resume(0, **RESUME_OK), room="s", match="round 1, expected round 2")
    s2 = s_room()
    s2.on_init(0, blocks=(1,), allocated_tokens=4, expected_ranks=1)
    assert_illegal(s2, lambda: s2.on_resume(0, **RESUME_OK), room="s", match="not expected")  # no input yet
    s3 = s_room()
    s3.on_init(0, blocks=(1, 2), allocated_tokens=8, expected_ranks=1)
    s3.on_input(8)
    s3.start_write(0)  # the last round: nothing follows it
    assert_illegal(s3, lambda: s3.on_resume(0, **RESUME_OK), room="s", match="not expected")


# -- early RESUME (the next round announced while this one is written) ---------------------------------


def test_sender_total_is_sent_for_round_0_of_a_longer_room_only() -> None:
    s, t = s_writing()  # 20 tokens, 8 reserved
    assert s.total_for(t) == Total(room="s", total_tokens=20)
    s.write_done(t)
    s.on_resume(0, **RESUME_OK)
    t1 = s.start_write(0)
    assert s.total_for(t1) is None  # round 1: the receiver knows the total from round 0's STATUS
    short = s_room()
    short.on_init(0, blocks=(1, 2), allocated_tokens=8, expected_ranks=1)
    short.on_input(8)
    assert short.total_for(short.start_write(0)) is None  # one round holds it
    chunked = s_room()
    chunked.on_init(0, blocks=(1, 2), allocated_tokens=8, expected_ranks=1, progress_tokens=BS)
    chunked.on_input(20)
    assert chunked.total_for(chunked.start_write(0)) == Total(room="s", total_tokens=20)  # with PROGRESS too


def test_sender_writes_an_early_round_as_soon_as_the_round_before_it_ends() -> None:
    s, t = s_writing()  # 20 tokens, round 0 = 8 into (1, 2)
    s.on_resume(0, round=1, sent_tokens=8, blocks=(5, 6), allocated_tokens=8)  # early
    assert s.ranks[0].phase is RankPhase.WRITING and s.ready_ranks() == []
    assert_illegal(s, lambda: s.on_resume(0, round=1, sent_tokens=8, blocks=(5, 6), allocated_tokens=8), room="s",
                   match="not expected")  # one round ahead at most
    st0 = s.write_done(t)
    assert (st0.state, st0.round, st0.sent_tokens) == ("TRANSFERRING", 0, 8)
    assert s.ranks[0].phase is RankPhase.READY and s.ranks[0].ahead is None
    t1 = s.start_write(0)
    assert t1 == WriteTask(rank=0, round=1, start=8, count=8, blocks=(5, 6))
    s.on_resume(0, round=2, sent_tokens=16, blocks=(7,), allocated_tokens=4)  # early again, while round 1 runs
    st1 = s.write_done(t1)
    assert (st1.state, st1.round, st1.sent_tokens) == ("TRANSFERRING", 1, 16)
    t2 = s.start_write(0)
    assert t2 == WriteTask(rank=0, round=2, start=16, count=4, blocks=(7,))
    assert s.write_done(t2).state == "SUCCESS"
    assert s.ranks[0].phase is RankPhase.DONE  # (rank 1 of the room's two has not sent INIT)


def test_sender_writes_an_early_round_alongside_the_round_before_it_and_announces_them_in_order() -> None:
    s, t = s_writing()  # 20 tokens, round 0 = 8 into (1, 2)
    assert s.may_follow(t) and s.ahead_ranks() == []
    assert_illegal(s, lambda: s.start_ahead(0), room="s", match="no write ahead is due for rank 0")
    s.on_resume(0, round=1, sent_tokens=8, blocks=(5, 6), allocated_tokens=8)  # early
    assert s.ahead_ranks() == [0]
    t1 = s.start_ahead(0)
    assert t1 == WriteTask(rank=0, round=1, start=8, count=8, blocks=(5, 6))
    assert s.ahead_ranks() == [] and s.ready_ranks() == [] and s.total_for(t1) is None
    assert_illegal(s, lambda: s.start_ahead(0), room="s", match="no write ahead")  # once
    assert_illegal(s, lambda: s.write_done(t1), room="s", match="round 1 was not expected")  # STATUS 0 goes first
    assert_illegal(s, lambda: s.on_resume(0, round=2, sent_tokens=16, blocks=(7,), allocated_tokens=4), room="s",
                   match="not expected")  # one round ahead at most, written or not
    st0 = s.write_done(t)
    assert (st0.state, st0.round, st0.sent_tokens) == ("TRANSFERRING", 0, 8)
    p = s.ranks[0]
    assert (p.phase, p.round, p.ahead, p.ahead_started) == (RankPhase.WRITING, 1, None, False)
    assert s.ready_ranks() == [] and s.writing(0)  # round 1 is being written: no second write of it
    s.on_resume(0, round=2, sent_tokens=16, blocks=(7,), allocated_tokens=4)  # early, while round 1 runs ahead
    assert not s.may_follow(WriteTask(rank=0, round=2, start=16, count=4, blocks=(7,)))  # the last round
    t2 = s.start_ahead(0)
    assert t2 == WriteTask(rank=0, round=2, start=16, count=4, blocks=(7,))
    st1 = s.write_done(t1)
    assert (st1.state, st1.round, st1.sent_tokens) == ("TRANSFERRING", 1, 16)
    assert s.write_done(t2).state == "SUCCESS"
    assert s.ranks[0].phase is RankPhase.DONE


def test_sender_writes_no_round_ahead_once_the_room_failed() -> None:
    s, _ = s_writing()
    s.on_resume(0, round=1, sent_tokens=8, blocks=(5, 6), allocated_tokens=8)
    s.fail("the receiver is gone")
    assert s.ahead_ranks() == []
    assert_illegal(s, lambda: s.start_ahead(0), room="s", match="no write ahead")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"round": 2}, "round 2, expected round 1"),
        ({"sent_tokens": 0}, "0 tokens arrived, 8 were sent once round 0 ends"),
        ({"sent_tokens": 16}, "16 tokens arrived"),
        ({"blocks": (5, 6, 7, 8), "allocated_tokens": 13}, "only 12 remain"),
        ({"blocks": (5, 5)}, "duplicate"),
    ],
)
def test_sender_bad_early_resume(changes: dict[str, Any], match: str) -> None:
    s, _ = s_writing()
    kw = {**RESUME_OK, **changes}
    assert_illegal(s, lambda: s.on_resume(0, **kw), room="s", state="TRANSFERRING", match=match)
    s.on_resume(0, **RESUME_OK)
    assert s.ranks[0].ahead == (1, (5, 6), 8)


def test_receiver_total_then_early_resume_then_rounds_in_order() -> None:
    r = r_waiting()  # round 0: 8 tokens reserved, total unknown
    r.on_total(Total(room="r", total_tokens=20))
    assert r.total == 20 and r.state is TS.TRANSFERRING and not r.ahead
    assert r.resume_sent(blocks=2, allocated_tokens=8) == (1, 8)  # early: round 1 starts at 8
    assert r.ahead and r.round == 0
    assert_illegal(r, lambda: r.resume_sent(blocks=1, allocated_tokens=4), room="r", match="second early RESUME")
    a0 = r.on_status(status())  # round 0: 8 of 20
    assert a0 is not None and (a0.start, a0.count, a0.complete) == (0, 8, False)
    assert r.round == 1 and not r.ahead  # round 1 is the one in flight now, awaited
    assert r.resume_sent(blocks=1, allocated_tokens=4) == (2, 16)  # early again: round 2 starts at 16
    a1 = r.on_status(status(sent=16, rnd=1))
    assert a1 is not None and (a1.start, a1.count) == (8, 8) and r.round == 2
    assert_illegal(r, lambda: r.resume_sent(blocks=1, allocated_tokens=4), room="r",
                   match="round 2 ends the request")  # nothing follows round 2
    a2 = r.on_status(status(state="SUCCESS", sent=20, rnd=2))
    assert a2 is not None and a2.complete and r.state is TS.SUCCESS


def test_receiver_early_resume_needs_the_total() -> None:
    r = r_waiting()
    assert_illegal(r, lambda: r.resume_sent(blocks=2, allocated_tokens=8), room="r", match="RESUME")  # total unknown
    p = r_boot()
    p.init_sent(blocks=2, allocated_tokens=8, progress_tokens=BS)
    p.on_progress(Progress(room="r", round=0, sent_tokens=BS, total_tokens=20))  # a PROGRESS tells the total too
    assert p.resume_sent(blocks=2, allocated_tokens=8) == (1, 8)
    landed = p.on_status(status())
    assert landed is not None and (landed.start, landed.count, landed.offset) == (BS, 8 - BS, BS)
    assert p.round == 1 and not p.ahead
    q = r_resumed()  # round 1 (8..16 of 20) awaited: 4 tokens follow it
    assert_illegal(q, lambda: q.resume_sent(blocks=2, allocated_tokens=5), room="r", match="4 remaining")
    assert q.resume_sent(blocks=1, allocated_tokens=4) == (2, 16)


@pytest.mark.parametrize(
    ("make", "total", "match"),
    [
        ("waiting", 8, "which round 0's reservation of 8 holds"),
        ("waiting", 1001, "max_request_tokens"),
        ("transferring", 20, "once, while round 0"),
        ("resumed", 20, "once, while round 0"),
        ("boot", 20, "once, while round 0"),
        ("success", 20, "TOTAL"),
    ],
)
def test_receiver_bad_total(make: str, total: int, match: str) -> None:
    r = RECEIVER_STATES[make]()
    assert_illegal(r, lambda: r.on_total(Total(room="r", total_tokens=total)), room="r", match=match)


def test_receiver_total_twice_and_a_changed_total_in_status() -> None:
    r = r_waiting()
    r.on_total(Total(room="r", total_tokens=20))
    assert_illegal(r, lambda: r.on_total(Total(room="r", total_tokens=20)), room="r", match="once")
    assert_illegal(r, lambda: r.on_status(status(total=21)), room="r", match="total changed from 20 to 21")


def test_receiver_failed_status_drops_the_early_round() -> None:
    r = r_waiting()
    r.on_total(Total(room="r", total_tokens=20))
    r.resume_sent(blocks=2, allocated_tokens=8)
    assert r.on_status(status(state="FAILED", total=20, sent=0)) is None
    assert r.state is TS.FAILED and not r.ahead


def test_sender_resume_after_done() -> None:
    s = s_room()
    s.on_init(0, blocks=(1,), allocated_tokens=4, expected_ranks=1)
    s.on_input(4)
    s.write_done(s.start_write(0))
    assert s.state is TS.SUCCESS
    assert_illegal(s, lambda: s.on_resume(0, round=1, sent_tokens=4, blocks=(2,), allocated_tokens=1),
                   room="s", state="SUCCESS")


def test_sender_resume_after_failure_refused() -> None:
    s = s_awaiting()
    s.fail("aborted by receiver", aborted=True)
    assert_illegal(s, lambda: s.on_resume(0, **RESUME_OK), room="s", state="ABORTED")


# -- both sides against each other ------------------------------------------------------------

LAYOUT = Layout(x=Field((), torch.int32), y=Field((2,), torch.int64))


def source_rows(total: int) -> dict[str, torch.Tensor]:
    x = torch.arange(total, dtype=torch.int32) * 7 + 3
    y = torch.stack([torch.arange(total, dtype=torch.int64) * -5, torch.arange(total, dtype=torch.int64) << 33],
                    dim=1)
    return {"x": x, "y": y.contiguous()}


class _Rank:
    """One receiver rank: its room machine, pool, free block ids and output."""

    def __init__(self, room: Any, bs: int, pool_blocks: int, max_tokens: int) -> None:
        self.room = ReceiverRoomState(room, block_size=bs, max_tokens=max_tokens)
        self.pool = BlockPool(LAYOUT, num_blocks=pool_blocks, block_size=bs)
        for t in self.pool.tensors.values():
            t.fill_(-1)
        self.free = set(range(pool_blocks))
        self.blocks: list[int] = []
        self.out: dict[str, torch.Tensor] | None = None
        self.statuses = 0
        self.announced = False
        self.reservations: list[int] = []
        self.ahead: list[int] = []
        """Blocks of the next round, announced early (before the STATUS of the round in flight)."""
        self.late: Resume | None = None
        """An early RESUME still on its way to the sender (it may arrive after the sender's STATUS crossed it)."""
        self.flight: tuple[WriteTask, bool] | None = None
        """A round written ahead, alongside the round before it (and whether its rows landed already)."""


def write_task(task: WriteTask, src: dict[str, torch.Tensor], dst: BlockPool, bs: int) -> None:
    """What the sender's I/O layer does: plan and copy real bytes into the receiver's pool."""
    runs = plan_row_runs(num_tokens=task.count, block_size=bs, dst_blocks=task.blocks, src_start=task.start)
    spans = [FieldSpan(src_base=src[n].data_ptr(), dst_base=dst.tensors[n].data_ptr(), row_bytes=f.row_bytes)
             for n, f in LAYOUT.items()]
    for op in plan_writes(runs, spans):
        ctypes.memmove(op.dst, op.src, op.length)


def reserve(rank: _Rank, bs: int, blocks: int, tokens: int, order: list[int], *, ahead: bool = False
            ) -> tuple[int, ...]:
    ids = tuple(order[:blocks])
    assert set(ids) <= rank.free
    rank.free -= set(ids)
    if ahead:
        rank.ahead = list(ids)
    else:
        rank.blocks = list(ids)
    rank.reservations.append(tokens)
    return ids


class DuelMachine(RuleBasedStateMachine):
    """A SenderRoomState and one ReceiverRoomState per rank, talking through encode/decode."""

    @initialize(
        total=st.integers(1, 120), bs=st.integers(1, 6), world=st.integers(1, 3), pool=st.integers(1, 10),
        room=st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.text(min_size=1, max_size=20)),
        input_first=st.booleans(),
    )
    def setup(self, *, total: int, bs: int, world: int, pool: int, room: Any, input_first: bool) -> None:
        self.total, self.bs, self.world, self.pool_blocks, self.room_id = total, bs, world, pool, room
        self.src = source_rows(total)
        self.sender = SenderRoomState(room, block_size=bs, num_blocks=pool)
        self.ranks = [_Rank(room, bs, pool, max_tokens=total) for _ in range(world)]
        self.inited: set[int] = set()
        if input_first:
            self.sender.on_input(total)

    def _draw_reservation(self, data: st.DataObject, rank: _Rank, limit: int, *, ahead: bool = False
                          ) -> tuple[tuple[int, ...], int]:
        max_blocks = min(len(rank.free), math.ceil(limit / self.bs))
        blocks = data.draw(st.integers(1, max_blocks), label="blocks")
        lo = (blocks - 1) * self.bs + 1
        tokens = data.draw(st.integers(lo, min(blocks * self.bs, limit)), label="tokens")
        order = data.draw(st.permutations(sorted(rank.free)), label="ids")
        return reserve(rank, self.bs, blocks, tokens, order, ahead=ahead), tokens

    def _maybe_early(self, data: st.DataObject, i: int, rank: _Rank) -> None:
        """Perhaps announce the rank's next round early: its total is known and a round follows the one in hand."""
        r = rank.room
        if r.ahead or r.total is None or not rank.blocks or not rank.free:
            return
        start = r.received + r.allocated
        remaining = self.total - start
        if remaining <= 0 or not data.draw(st.booleans(), label="early"):
            return
        # one starting where the round in hand starts is refused, and changes nothing
        assert_illegal(self.sender, lambda: self.sender.on_resume(
            i, round=r.round + 1, sent_tokens=r.received, blocks=(0,), allocated_tokens=1), room=self.room_id)
        ids, tokens = self._draw_reservation(data, rank, remaining, ahead=True)
        assert r.resume_sent(blocks=len(ids), allocated_tokens=tokens) == (r.round + 1, start)
        msg = decode(encode(Resume(room=self.room_id, round=r.round + 1, sent_tokens=start, blocks=ids,
                                   allocated_tokens=tokens)))
        assert isinstance(msg, Resume)
        if data.draw(st.booleans(), label="late"):
            rank.late = msg  # on its way: it may reach the sender after the round's STATUS went out (deliver_late)
            return
        self.sender.on_resume(i, round=msg.round, sent_tokens=msg.sent_tokens, blocks=msg.blocks,
                              allocated_tokens=msg.allocated_tokens)
        assert self.sender.ranks[i].ahead == (msg.round, ids, tokens)
        event("early RESUME")

    def _deliver_late(self, i: int, rank: _Rank) -> None:
        msg, rank.late = rank.late, None
        assert msg is not None
        p = self.sender.ranks[i]
        crossed = p.phase is RankPhase.AWAITING_RESUME  # the round's STATUS went out before it came
        self.sender.on_resume(i, round=msg.round, sent_tokens=msg.sent_tokens, blocks=msg.blocks,
                              allocated_tokens=msg.allocated_tokens)
        if crossed:  # taken as a RESUME after the STATUS: the same round, from the same token
            assert p.phase is RankPhase.READY and p.ahead is None and (p.round, p.sent) == (msg.round, msg.sent_tokens)
            event("early RESUME, crossed by the STATUS")
        else:
            assert p.ahead == (msg.round, msg.blocks, msg.allocated_tokens)
            event("early RESUME, delivered before the STATUS")

    @rule(data=st.data())
    def deliver_late(self, data: st.DataObject) -> None:
        """An early RESUME on its way arrives: before the round's STATUS went out, or after (the crossing)."""
        pending = [i for i, r in enumerate(self.ranks) if r.late is not None]
        if pending:
            i = data.draw(st.sampled_from(pending), label="rank")
            self._deliver_late(i, self.ranks[i])

    @rule(data=st.data())
    def early_resume(self, data: st.DataObject) -> None:
        """A round in hand, not yet written (the sender READY): the next one may be announced already."""
        ready = [i for i in self.sender.ready_ranks() if self.ranks[i].blocks]
        if ready:
            i = data.draw(st.sampled_from(ready), label="rank")
            self._maybe_early(data, i, self.ranks[i])

    @rule(data=st.data())
    def init(self, data: st.DataObject) -> None:
        pending = [i for i in range(self.world) if i not in self.inited]
        if not pending:
            return
        i = data.draw(st.sampled_from(pending), label="rank")
        rank = self.ranks[i]
        # the receiver does not know the length: it may reserve more than the total
        ids, tokens = self._draw_reservation(data, rank, self.pool_blocks * self.bs)
        # a streaming rank asks for PROGRESS every k blocks within a round
        progress = data.draw(st.sampled_from([0, 0, self.bs, 2 * self.bs]), label="progress")
        rank.room.init_sent(blocks=len(ids), allocated_tokens=tokens, progress_tokens=progress)
        msg = decode(encode(Init(room=self.room_id, blocks=ids, allocated_tokens=tokens,
                                 expected_ranks=self.world, progress_tokens=progress)))
        assert isinstance(msg, Init)
        self.sender.on_init(i, blocks=msg.blocks, allocated_tokens=msg.allocated_tokens,
                            expected_ranks=msg.expected_ranks, progress_tokens=msg.progress_tokens)
        self.inited.add(i)
        # a second INIT of the same rank is refused
        assert_illegal(self.sender, lambda: self.sender.on_init(
            i, blocks=msg.blocks, allocated_tokens=msg.allocated_tokens, expected_ranks=self.world),
            room=self.room_id, match="duplicate INIT")

    @precondition(lambda self: self.sender.total is None)
    @rule()
    def give_input(self) -> None:
        self.sender.on_input(self.total)

    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        ready = self.sender.ready_ranks()
        if not ready:
            return
        i = data.draw(st.sampled_from(ready), label="rank")
        rank = self.ranks[i]
        task = self.sender.start_write(i)
        assert task.blocks == tuple(rank.blocks)
        assert task.start == rank.room.received
        total = self.sender.total_for(task)
        assert (total is not None) == (task.round == 0 and task.start + task.count < self.total)
        if total is not None:
            tmsg = decode(encode(total))
            assert isinstance(tmsg, Total)
            rank.room.on_total(tmsg)
            assert_illegal(rank.room, lambda: rank.room.on_total(tmsg), room=self.room_id, match="once")
        self._maybe_early(data, i, rank)  # while this round is written
        self._maybe_ahead(data, i, rank, task)
        self._land(i, rank, task, written=False)

    def _maybe_ahead(self, data: st.DataObject, i: int, rank: _Rank, task: WriteTask) -> None:
        """Perhaps start writing the round announced early while ``task`` is written; its rows may land first."""
        if i not in self.sender.ahead_ranks() or not data.draw(st.booleans(), label="ahead"):
            return
        p = self.sender.ranks[i]
        assert p.ahead is not None
        allocated = p.ahead[2]
        ahead = self.sender.start_ahead(i)
        assert ahead.round == task.round + 1 and ahead.start == task.start + task.count
        assert ahead.blocks == tuple(rank.ahead) and ahead.count == min(allocated, self.total - ahead.start)
        assert_illegal(self.sender, lambda: self.sender.start_ahead(i), room=self.room_id, match="no write ahead")
        # its STATUS cannot go before the round before it was announced
        assert_illegal(self.sender, lambda: self.sender.write_done(ahead), room=self.room_id, match="not expected")
        landed = data.draw(st.booleans(), label="lands first")
        if landed:  # into its own blocks: the round before it reads (copies out) only its own
            write_task(ahead, self.src, rank.pool, self.bs)
        rank.flight = (ahead, landed)
        event("round written ahead" + (", landed first" if landed else ""))

    @rule(data=st.data())
    def finish_ahead(self, data: st.DataObject) -> None:
        """A round written ahead ends (after the round before it was announced): the next round may be announced
        early and written ahead meanwhile."""
        flying = [i for i, r in enumerate(self.ranks) if r.flight is not None]
        if not flying:
            return
        i = data.draw(st.sampled_from(flying), label="rank")
        rank = self.ranks[i]
        assert rank.flight is not None
        (task, landed), rank.flight = rank.flight, None
        assert self.sender.ranks[i].phase is RankPhase.WRITING and i not in self.sender.ready_ranks()
        self._maybe_early(data, i, rank)
        self._maybe_ahead(data, i, rank, task)
        self._land(i, rank, task, written=landed)

    def _land(self, i: int, rank: _Rank, task: WriteTask, *, written: bool) -> None:
        """The rest of ``task``'s rows land (all of them unless ``written``), announced as the sender says."""
        meta = {"room": str(self.room_id), "rank": i}
        at = task.start
        for upto in self.sender.progress_points(task):  # chunks announced within the round, in order
            if not written:
                write_task(WriteTask(task.rank, task.round, at, upto - at,
                                     task.blocks[(at - task.start) // self.bs:]), self.src, rank.pool, self.bs)
            pmsg = decode(encode(self.sender.write_progress(task, upto, metadata=meta)))
            assert isinstance(pmsg, Progress)
            part = rank.room.on_progress(pmsg)
            assert part.partial and (part.start, part.start + part.count) == (at, upto)
            assert part.offset == at - task.start and part.offset % self.bs == 0
            assert (part.metadata == meta) == (not rank.announced)  # metadata with the first announcement only
            rank.announced = True
            if rank.out is None:
                rank.out = LAYOUT.empty(self.total)
            rank.pool.copy_out(rank.blocks[part.offset // self.bs:], part.count, rank.out, out_start=part.start)
            at = upto
            # the same PROGRESS again, or one past the round's end, is refused
            assert_illegal(rank.room, lambda pmsg=pmsg: rank.room.on_progress(pmsg), room=self.room_id)
        if not written:
            write_task(WriteTask(task.rank, task.round, at, task.start + task.count - at,
                                 task.blocks[(at - task.start) // self.bs:]), self.src, rank.pool, self.bs)
        msg = decode(encode(self.sender.write_done(task, metadata=meta)))
        assert isinstance(msg, Status)
        arrived = rank.room.on_status(msg)
        assert arrived is not None
        assert arrived.start == at and arrived.start + arrived.count == task.start + task.count
        assert arrived.total == self.total and arrived.offset == at - task.start
        assert (arrived.metadata == meta) == (not rank.announced)
        rank.announced = True
        rank.statuses += 1
        if rank.out is None:
            rank.out = LAYOUT.empty(self.total)  # allocated once, when the total is known
        rank.pool.copy_out(rank.blocks[arrived.offset // self.bs:], arrived.count, rank.out, out_start=arrived.start)
        rank.free |= set(rank.blocks)
        rank.blocks, rank.ahead = rank.ahead, []  # a round announced early is the one in hand now
        assert arrived.complete == (arrived.start + arrived.count == self.total)
        assert rank.room.metadata == meta  # kept from the first announcement

    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        waiting = [i for i, r in enumerate(self.ranks)
                   if r.room.state is TS.TRANSFERRING and not r.blocks]
        if not waiting:
            return
        i = data.draw(st.sampled_from(waiting), label="rank")
        rank = self.ranks[i]
        remaining = self.total - rank.room.received
        # out-of-turn / wrong RESUMEs first: each refused, nothing changes
        good_round = rank.room.round + 1
        for bad in (
            {"round": good_round + 1}, {"round": good_round - 1},
            {"sent_tokens": rank.room.received + 1}, {"sent_tokens": max(0, rank.room.received - 1)},
        ):
            kw = {"round": good_round, "sent_tokens": rank.room.received, "blocks": (0,),
                  "allocated_tokens": min(self.bs, remaining), **bad}
            if kw["sent_tokens"] != rank.room.received or kw["round"] != good_round:
                assert_illegal(self.sender, lambda kw=kw: self.sender.on_resume(i, **kw), room=self.room_id)
        if remaining + 1 <= self.pool_blocks * self.bs:
            over_blocks = tuple(range(math.ceil((remaining + 1) / self.bs)))
            assert_illegal(self.sender, lambda: self.sender.on_resume(
                i, round=good_round, sent_tokens=rank.room.received, blocks=over_blocks,
                allocated_tokens=remaining + 1), room=self.room_id)
        assert_illegal(self.sender, lambda: self.sender.on_resume(
            i, round=good_round, sent_tokens=rank.room.received, blocks=(self.pool_blocks,),
            allocated_tokens=min(self.bs, remaining)), room=self.room_id, match="outside")

        ids, tokens = self._draw_reservation(data, rank, remaining)
        rank.room.resume_sent(blocks=len(ids), allocated_tokens=tokens)
        assert rank.room.round == good_round
        msg = decode(encode(Resume(room=self.room_id, round=rank.room.round, sent_tokens=rank.room.received,
                                   blocks=ids, allocated_tokens=tokens)))
        assert isinstance(msg, Resume)
        self.sender.on_resume(i, round=msg.round, sent_tokens=msg.sent_tokens, blocks=msg.blocks,
                              allocated_tokens=msg.allocated_tokens)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "sender"):
            return
        for i, rank in enumerate(self.ranks):
            r = rank.room
            assert r.received <= self.total
            assert len(rank.free) + len(rank.blocks) + len(rank.ahead) == self.pool_blocks
            assert bool(rank.ahead) == r.ahead
            if i in self.sender.ranks:
                p = self.sender.ranks[i]
                assert p.sent == r.received  # every write is acknowledged in the same step
                if rank.late is not None and p.phase is RankPhase.AWAITING_RESUME:
                    assert p.round + 1 == r.round  # the receiver moved on to the round whose RESUME is on its way
                else:
                    assert p.round == r.round
                assert (p.phase is RankPhase.DONE) == (r.state is TS.SUCCESS)
            else:
                assert r.state is TS.BOOTSTRAPPING
            assert r.round == len(rank.reservations) - 1 - bool(rank.ahead) if rank.reservations else r.round == 0
        all_done = len(self.inited) == self.world and all(r.room.state is TS.SUCCESS for r in self.ranks)
        assert (self.sender.state is TS.SUCCESS) == all_done

    def teardown(self) -> None:
        if not hasattr(self, "sender"):
            return
        # drive every rank to completion with maximal reservations
        if self.sender.total is None:
            self.sender.on_input(self.total)
        for i, rank in enumerate(self.ranks):
            if rank.flight is not None:
                (task, landed), rank.flight = rank.flight, None
                self._land(i, rank, task, written=landed)
            if rank.late is not None:
                self._deliver_late(i, rank)
            if i not in self.inited:
                ids = reserve(rank, self.bs, self.pool_blocks, self.pool_blocks * self.bs, sorted(rank.free))
                rank.room.init_sent(blocks=len(ids), allocated_tokens=self.pool_blocks * self.bs)
                self.sender.on_init(i, blocks=ids, allocated_tokens=self.pool_blocks * self.bs,
                                    expected_ranks=self.world)
            while rank.room.state is not TS.SUCCESS:
                if rank.blocks:
                    task = self.sender.start_write(i)
                    write_task(task, self.src, rank.pool, self.bs)
                    arrived = rank.room.on_status(decode(encode(self.sender.write_done(task))))  # type: ignore[arg-type]
                    assert arrived is not None
                    if rank.out is None:
                        rank.out = LAYOUT.empty(self.total)
                    rank.pool.copy_out(rank.blocks, arrived.count, rank.out, out_start=arrived.start)
                    rank.free |= set(rank.blocks)
                    rank.blocks, rank.ahead = rank.ahead, []
                    rank.statuses += 1
                else:
                    remaining = self.total - rank.room.received
                    tokens = min(remaining, self.pool_blocks * self.bs)
                    ids = reserve(rank, self.bs, math.ceil(tokens / self.bs), tokens, sorted(rank.free))
                    rank.room.resume_sent(blocks=len(ids), allocated_tokens=tokens)
                    self.sender.on_resume(i, round=rank.room.round, sent_tokens=rank.room.received, blocks=ids,
                                          allocated_tokens=tokens)
        assert self.sender.state is TS.SUCCESS
        event(f"max rounds {max(r.room.round for r in self.ranks) + 1}")
        for rank in self.ranks:
            r = rank.room
            assert r.state is TS.SUCCESS and r.received == r.total == self.total
            assert rank.out is not None
            assert torch.equal(rank.out["x"], self.src["x"])
            assert torch.equal(rank.out["y"], self.src["y"])
            assert rank.statuses == r.round + 1 == len(rank.reservations)
            # every round but the last filled its whole reservation; the last took the rest
            assert sum(rank.reservations[:-1]) < self.total <= sum(rank.reservations)
            assert rank.free == set(range(self.pool_blocks))


DuelMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestDuel = DuelMachine.TestCase


def drive(total: int, *, bs: int, default: int, round_tokens: int, world: int = 1) -> list[int]:
    """Run a room to completion with fixed reservation sizes; return rounds per rank."""
    s = SenderRoomState("d", block_size=bs)
    recv = [ReceiverRoomState("d", block_size=bs, max_tokens=1 << 30) for _ in range(world)]
    for i, r in enumerate(recv):
        r.init_sent(blocks=math.ceil(default / bs), allocated_tokens=default)
        s.on_init(i, blocks=tuple(range(math.ceil(default / bs))), allocated_tokens=default, expected_ranks=world)
    s.on_input(total)
    while s.state is not TS.SUCCESS:
        for i in s.ready_ranks():
            r = recv[i]
            arrived = r.on_status(s.write_done(s.start_write(i)))
            assert arrived is not None
            if not arrived.complete:
                tokens = min(round_tokens, arrived.remaining)
                r.resume_sent(blocks=math.ceil(tokens / bs), allocated_tokens=tokens)
                s.on_resume(i, round=r.round, sent_tokens=r.received, blocks=tuple(range(math.ceil(tokens / bs))),
                            allocated_tokens=tokens)
    assert all(r.state is TS.SUCCESS and r.received == total for r in recv)
    return [r.round + 1 for r in recv]


@pytest.mark.parametrize(
    ("total", "bs", "default", "round_tokens"),
    [(1, 4, 8, 8), (8, 4, 8, 8), (9, 4, 8, 8), (8192, 128, 8192, 8192), (8193, 128, 8192, 8192),
     (20000, 128, 8192, 4096), (65536, 128, 8192, 65536), (100_000, 128, 8192, 1280), (37, 3, 6, 9)],
)
def test_round_count_is_ceil_based(total: int, bs: int, default: int, round_tokens: int) -> None:
    expected = 1 + math.ceil(max(0, total - default) / round_tokens)
    assert drive(total, bs=bs, default=default, round_tokens=round_tokens, world=2) == [expected, expected]


def test_ranks_progress_independently() -> None:
    s = SenderRoomState("p", block_size=4)
    r0 = ReceiverRoomState("p", block_size=4, max_tokens=100)
    r1 = ReceiverRoomState("p", block_size=4, max_tokens=100)
    r0.init_sent(blocks=1, allocated_tokens=4)
    r1.init_sent(blocks=3, allocated_tokens=12)
    s.on_init(0, blocks=(0,), allocated_tokens=4, expected_ranks=2)
    s.on_input(10)
    # rank 0 goes through all three rounds before rank 1 has even sent INIT
    for _ in range(3):
        a = r0.on_status(s.write_done(s.start_write(0)))
        assert a is not None
        if not a.complete:
            t = min(4, a.remaining)
            r0.resume_sent(blocks=1, allocated_tokens=t)
            s.on_resume(0, round=r0.round, sent_tokens=r0.received, blocks=(1,), allocated_tokens=t)
    assert r0.state is TS.SUCCESS and r0.round == 2
    assert s.state is TS.TRANSFERRING
    s.on_init(1, blocks=(4, 5, 6), allocated_tokens=12, expected_ranks=2)
    t1 = s.start_write(1)
    assert (t1.round, t1.start, t1.count) == (0, 0, 10)
    a1 = r1.on_status(s.write_done(t1))
    assert a1 is not None and a1.complete and r1.round == 0
    assert s.state is TS.SUCCESS
    assert s.ranks[0].round == 2 and s.ranks[1].round == 0


# -- a hostile sender's frames against the receiver's machine ----------------------------------------------------


def _hostile_tokens(data: st.DataObject, m: ReceiverRoomState) -> int:
    """A token count near where the machine stands (the edges of the round, the total), or anywhere."""
    near = [m.received, m.landed, m.received + m.allocated, m.total or 0, 2 * (m.received + m.allocated)]
    return data.draw(st.one_of(
        st.builds(lambda base, d: max(0, base + d), st.sampled_from(near), st.sampled_from([0, 0, 0, 1, -1, BS, -BS])),
        st.sampled_from([0, 1, (1 << 22) - 1, 1 << 22, (1 << 22) + 1, 1 << 40])))


def _hostile_event(data: st.DataObject, m: ReceiverRoomState) -> tuple[str, Any]:
    kind = data.draw(st.sampled_from(["status", "status", "progress", "progress", "total", "resume"]))
    rnd = data.draw(st.sampled_from([m.round, m.round, m.round + 1, max(0, m.round - 1)]))
    meta = data.draw(st.sampled_from([None, {"m": 1}]))
    if kind == "status":
        state = data.draw(st.sampled_from([TS.TRANSFERRING, TS.SUCCESS, *TS]))
        return kind, Status(room=1, state=state, total_tokens=_hostile_tokens(data, m),
                            sent_tokens=_hostile_tokens(data, m), round=rnd, metadata=meta)
    if kind == "progress":
        return kind, Progress(room=1, round=rnd, sent_tokens=_hostile_tokens(data, m),
                              total_tokens=_hostile_tokens(data, m), metadata=meta)
    if kind == "total":
        return kind, Total(room=1, total_tokens=max(1, _hostile_tokens(data, m)))
    return kind, (data.draw(st.integers(1, 6)), data.draw(st.integers(1, 24)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.integers(1, 6), tokens=st.integers(1, 24), progress=st.booleans(), data=st.data())
def test_receiver_hostile_frames_change_nothing_or_hand_out_reserved_rows(
        blocks: int, tokens: int, progress: bool, data: st.DataObject) -> None:
    """Whatever a sender sends, in whatever order, between the receiver's own RESUMEs: an event the machine
    refuses raises ``ProtocolError`` and changes nothing; one it takes hands out the next rows of the request, in
    token order, within the reservation of the round they belong to, and never past the total."""
    m = ReceiverRoomState(1, block_size=BS, max_tokens=1 << 22)
    try:
        m.init_sent(blocks=blocks, allocated_tokens=tokens, progress_tokens=BS if progress else 0)
    except ProtocolError:
        return
    handed = 0  # rows handed out so far
    for _ in range(data.draw(st.integers(1, 20))):
        if m.state.terminal:
            break
        kind, e = _hostile_event(data, m)
        before = snapshot(m)
        try:
            if kind == "status":
                got = m.on_status(e)
            elif kind == "progress":
                got = m.on_progress(e)
            elif kind == "total":
                m.on_total(e)
                got = None
            else:
                m.resume_sent(blocks=e[0], allocated_tokens=e[1])
                got = None
        except ProtocolError:
            assert snapshot(m) == before, (kind, e)
            continue
        if got is not None:
            assert e.round == before["round"], (e, before)  # the round in flight, and no other
            assert got.start == handed and got.count >= 0, (got, handed)
            assert got.offset + got.count <= before["allocated"], (got, before)
            handed = got.start + got.count
            assert handed <= got.total
        if m.total is not None:
            assert m.received <= m.landed <= m.total
