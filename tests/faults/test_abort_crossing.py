"""Frames about a room attempt that ended never reach the next attempt of its id.

Frames name a room by id alone. CI caught the race: the sender's ``abort()`` ended a room between rounds, the
receiver's RESUME for the next round and its ABORT crossed that end, the sender REJECTed the RESUME (a room it
no longer had), the receiver took that REJECT for the ABORT's answer and let the id go, and the real ABORT_ACK
then failed the id's next attempt ("ABORT_ACK without an ABORT"). A review then found the same family's worse
cases: such a REJECT reaching a live next attempt freed its reservation as never written while the sender wrote
into it. The receiver now holds an id that ended with an error until its ABORT is answered and the PONG of a
PING sent after the end came back (the sender answers in order: nothing of the earlier attempt follows it)."""

from __future__ import annotations

from contextlib import suppress

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import TaskGroup

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferConfig, TransferError, TransferTimeout
from aioembed.errors import InvalidRequest
from aioembed.protocol.messages import (
    Abort,
    AbortAck,
    FenceRelease,
    Hello,
    Init,
    Ping,
    Pong,
    Reject,
    Resume,
    Status,
    TransferStatus,
)
from aioembed.session.connection import FENCE_SETTLE
from aioembed.session.handle import ReceiveHandle
from aioembed.testing import MockTransport, WriteFault

from ..session.conftest import LAYOUT, assert_same, make_request, running, wait_pools_free
from .rawpeer import RawReceiver, RawSender, raw_sender, welcomed_receiver

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=128, max_round_tokens=128, pool_tokens=4096, input_timeout=5.0,
                     round_timeout=5.0, handshake_timeout=2.0, heartbeat_interval=30.0)
"""No heartbeat PING while a test holds PINGs to answer them itself (the first goes out at the handshake)."""


async def _round_zero_in(sender: EmbeddingSender, raw: RawReceiver, tg: TaskGroup) -> None:
    """Room "x" of 300 tokens, 128 reserved, its send() started in ``tg``: until round 0's STATUS came
    (the send() then waits for this rank's RESUME)."""
    async def send() -> None:
        with suppress(TransferError):
            await sender.send("x", make_request(300, 1))

    raw.send(Init(room="x", blocks=(0,), allocated_tokens=128, expected_ranks=1))
    tg.start_soon(send)
    first = await raw.expect(Status)
    assert isinstance(first, Status) and first.state is TransferStatus.TRANSFERRING and first.round == 0


async def test_a_resume_that_crossed_the_senders_abort_is_ignored_and_the_abort_answered() -> None:
    async with running(CFG) as (sender, _), welcomed_receiver(sender.address, LAYOUT, CFG) as raw:
        async with anyio.create_task_group() as tg:
            await _round_zero_in(sender, raw, tg)
            sender.abort("x", "the encoder failed on the image")
            end = await raw.expect(Status)
            assert isinstance(end, Status) and end.state is TransferStatus.ABORTED and "the encoder" in end.error
        assert sender.rooms_in_flight == 0
        # The rank had sent its RESUME, then ended the room itself, before that STATUS reached it.
        raw.send(Resume(room="x", round=1, sent_tokens=128, blocks=(1,), allocated_tokens=128))
        raw.send(Abort(room="x", reason="the client went away"))
        answer = await raw.expect((AbortAck, Reject))
        assert isinstance(answer, AbortAck) and answer.room == "x"  # no REJECT of the RESUME before it
        # A RESUME of a room this rank never asked for is still refused.
        raw.send(Resume(room="never", round=1, sent_tokens=0, blocks=(2,), allocated_tokens=128))
        rej = await raw.expect(Reject)
        assert isinstance(rej, Reject) and rej.room == "never" and "has not started" in rej.reason


async def test_a_reject_does_not_answer_the_receivers_abort() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), CFG.heartbeat_interval)
        handle = receiver.start("x")
        assert isinstance(await raw.expect(Init), Init)
        handle.cancel("the client went away")
        await handle.wait()
        abort = await raw.expect(Abort)
        assert isinstance(abort, Abort) and abort.room == "x"
        # The REJECT of a frame that crossed the room's end arrives first: the id stays held.
        raw.send(Reject(reason="RESUME for room 'x', which this rank has not started", room="x"))
        await anyio.sleep(0.2)
        with pytest.raises(InvalidRequest, match="not yet acknowledged the abort"):
            receiver.start("x")
        conn = receiver._connection(raw.address)
        assert receiver.keeper.ledger.holds_room(conn.writer, "x")  # nor does it free the fenced INIT blocks
        raw.send(AbortAck(room="x"))
        again = await _start_when_allowed(receiver, "x")
        init = await raw.expect(Init)
        assert isinstance(init, Init) and init.room == "x"
        again.cancel("test over")
        await again.wait()



async def _welcomed(raw: RawSender) -> None:
    raw.welcome(await raw.expect(Hello), CFG.heartbeat_interval)
    raw.hold_pings = True


async def _barrier(raw: RawSender, receiver: EmbeddingReceiver) -> Ping:
    """The PING the receiver sent after a room's end (heartbeat PINGs meanwhile are answered)."""
    conn = receiver._connection(raw.address)
    while True:
        ping = await raw.expect(Ping)
        assert isinstance(ping, Ping)
        if ping.nonce not in conn._pings:
            return ping
        raw.pong_to(ping)


async def _start_when_allowed(receiver: EmbeddingReceiver, room: str, sender: str | None = None) -> ReceiveHandle:
    """``receiver.start(room)`` once it is allowed: ``InvalidRequest`` until our ABORT of its earlier attempt
    is answered and its fenced blocks are freed."""
    with anyio.fail_after(10):
        while True:
            try:
                return receiver.start(room, sender=sender)
            except InvalidRequest:
                await anyio.sleep(0.005)


async def _cancelled_after_its_init(raw: RawSender, receiver: EmbeddingReceiver) -> Ping:
    """Room "x" asked for and cancelled at once (its ABORT seen): the PING sent after its end."""
    await _welcomed(raw)
    first = receiver.start("x")
    assert isinstance(await raw.expect(Init), Init)
    first.cancel("the client went away")
    await first.wait()
    assert isinstance(await raw.expect(Abort), Abort)
    return await _barrier(raw, receiver)


async def _no_init_within(raw: RawSender, seconds: float) -> None:
    with pytest.raises(TimeoutError):
        await raw.expect(Init, timeout=seconds)


async def test_a_reject_of_a_resume_that_crossed_the_senders_end_never_reaches_the_next_attempt() -> None:
    """Round 0 of 300 tokens landed; the receiver's RESUME for round 1 crossed the sender's final
    STATUS(ABORTED); the sender REJECTs it (it started the room again for a retried ``send()``). The
    receiver's next attempt of the id, started at once, sends its INIT only after that REJECT: it would
    have taken it for its own and freed its reservation as never written, while the sender wrote it."""
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        await _welcomed(raw)
        first = receiver.start("x")
        assert isinstance(await raw.expect(Init), Init)
        raw.send(Status(room="x", state=TransferStatus.TRANSFERRING, total_tokens=300, sent_tokens=128, round=0))
        resume = await raw.expect(Resume)
        assert isinstance(resume, Resume) and resume.round == 1
        raw.send(Status(room="x", state=TransferStatus.ABORTED, total_tokens=300, sent_tokens=0, round=0,
                        error="the encoder failed on the image"))
        with pytest.raises(TransferError, match="the encoder failed"):
            await first.result()
        barrier = await _barrier(raw, receiver)
        again = receiver.start("x")  # no InvalidRequest: it waits for the barrier
        await _no_init_within(raw, 0.3)
        raw.send(Reject(reason="RESUME for room 'x', which this rank has not started", room="x"))
        raw.pong_to(barrier)
        init = await raw.expect(Init)
        assert isinstance(init, Init) and init.room == "x"
        await anyio.sleep(0.2)
        conn = receiver._connection(raw.address)
        assert again.status is TransferStatus.WAITING_FOR_INPUT and not again.done
        assert receiver.keeper.ledger.holds_room(conn.writer, "x")  # its INIT blocks stay announced
        again.cancel("test over")
        await again.wait()


async def test_an_abort_ack_after_a_fence_status_never_reaches_the_next_attempt() -> None:
    """The room failed at the sender with a write that may still land (STATUS(fence=True)), which crossed
    the receiver's ABORT; the sender answers that ABORT too (an ABORT_ACK, once the write could no longer
    land). The next attempt of the id starts at once; its INIT waits for the barrier, which comes after
    that ABORT_ACK: the ACK no longer fails it ("ABORT_ACK without an ABORT")."""
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        barrier = await _cancelled_after_its_init(raw, receiver)
        raw.send(Status(room="x", state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0,
                        error="a write failed and may still land", fence=True))
        raw.send(FenceRelease(room="x"))
        again = await _start_when_allowed(receiver, "x")  # once the fence is released and settled
        await _no_init_within(raw, 0.3)
        raw.send(AbortAck(room="x"))
        raw.pong_to(barrier)
        assert isinstance(await raw.expect(Init), Init)
        await anyio.sleep(0.2)
        assert again.status is TransferStatus.WAITING_FOR_INPUT and not again.done
        again.cancel("test over")
        await again.wait()


async def test_a_room_id_whose_failed_write_is_fenced_is_refused_until_its_fence_release_settled() -> None:
    """FENCE_RELEASE names a room, not an attempt, and frees every fenced grant of the room's writer: it is safe
    only because no next attempt of the id announces blocks in that session before the FENCE_RELEASE it is
    owed came and settled (the sender sends one per room and session, once no write of the room into it can
    land). So a new attempt is refused while the earlier one's blocks are fenced."""
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        await _welcomed(raw)
        first = receiver.start("x")
        assert isinstance(await raw.expect(Init), Init)
        raw.send(Status(room="x", state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0,
                        error="a write failed and may still land", fence=True))
        with pytest.raises(TransferError, match="may still land"):
            await first.result()
        raw.pong_to(await _barrier(raw, receiver))
        await anyio.sleep(0.2)
        with pytest.raises(InvalidRequest, match="still fenced"):
            receiver.start("x")
        t0 = anyio.current_time()
        raw.send(FenceRelease(room="x"))
        again = await _start_when_allowed(receiver, "x")
        assert anyio.current_time() >= t0 + FENCE_SETTLE
        assert receiver.fenced_blocks == {}
        init = await raw.expect(Init)
        assert isinstance(init, Init) and init.room == "x"
        again.cancel("test over")
        await again.wait()


async def test_an_abort_ack_after_a_fence_release_frees_the_failed_writes_blocks_only_after_the_settle() -> None:
    """FENCE_RELEASE frees blocks a failed write may reach FENCE_SETTLE later (bytes already in our socket
    buffers land meanwhile); the ABORT_ACK right behind it, sent for the same reason, freed them at once."""
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        raw.pong_to(await _cancelled_after_its_init(raw, receiver))
        conn = receiver._connection(raw.address)
        t0 = anyio.current_time()
        raw.send(Status(room="x", state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0,
                        error="a write failed and may still land", fence=True))
        raw.send(FenceRelease(room="x"))
        raw.send(AbortAck(room="x"))
        with anyio.fail_after(5):
            while receiver.keeper.ledger.holds_room(conn.writer, "x"):
                await anyio.sleep(0.005)
        # Not at once: no sooner than the settle after they came. Compared as the ledger computes it (a sum): on
        # uvloop, whose clock ticks in milliseconds, the frames often come at t0 itself, and a difference of two
        # times near 5e4 s can round just under the settle.
        assert anyio.current_time() >= t0 + FENCE_SETTLE
        assert receiver.fenced_blocks == {}


async def test_abort_after_a_failed_send_keeps_the_ranks_that_asked() -> None:
    """``abort()`` after ``send()`` raised (a common ``except`` clause) rewrote the room's tombstone without
    its ranks: a RESUME of theirs that crossed the end was REJECTed again, not ignored."""
    async with running(CFG) as (sender, _), welcomed_receiver(sender.address, LAYOUT, CFG) as raw:
        async with anyio.create_task_group() as tg:
            await _round_zero_in(sender, raw, tg)
            sender.abort("x", "the encoder failed on the image")
            end = await raw.expect(Status)
            assert isinstance(end, Status) and end.state is TransferStatus.ABORTED
        sender.abort("x", "the application aborts it again after send() raised")
        raw.send(Resume(room="x", round=1, sent_tokens=128, blocks=(1,), allocated_tokens=128))
        raw.send(Abort(room="x", reason="the client went away"))
        answer = await raw.expect((AbortAck, Reject))
        assert isinstance(answer, AbortAck) and answer.room == "x"


async def test_a_reject_in_a_live_room_fences_what_it_announced_until_the_aborts_answer() -> None:
    """A REJECT names the frame it refused only in its text, and a refused frame leaves the sender's room going: the
    receiver ABORTs the room and keeps its announced blocks fenced until the ABORT is answered."""
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        await _welcomed(raw)
        handle = receiver.start("x")
        assert isinstance(await raw.expect(Init), Init)
        raw.send(Reject(reason="a frame of the room was refused", room="x"))
        with pytest.raises(TransferError, match="rejected it: a frame of the room was refused"):
            await handle.result()
        assert isinstance(await raw.expect(Abort), Abort)
        conn = receiver._connection(raw.address)
        assert receiver.keeper.ledger.holds_room(conn.writer, "x") and receiver.allocator.stats.fenced > 0
        raw.send(AbortAck(room="x"))
        raw.pong_to(await _barrier(raw, receiver))
        with anyio.fail_after(5):
            while receiver.keeper.ledger.holds_room(conn.writer, "x") or "x" in conn.held_ids:
                await anyio.sleep(0.005)
        assert receiver.fenced_blocks == {}


async def test_the_wait_for_an_unanswered_barrier_is_bounded_and_named() -> None:
    cfg = CFG.replace(handshake_timeout=1.0)
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, cfg, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), cfg.heartbeat_interval)
        raw.hold_pings = True
        first = receiver.start("x")
        assert isinstance(await raw.expect(Init), Init)
        raw.send(Status(room="x", state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0,
                        error="the encoder failed"))
        with pytest.raises(TransferError, match="the encoder failed"):
            await first.result()
        await _barrier(raw, receiver)  # never answered
        with anyio.fail_after(5), pytest.raises(TransferTimeout, match="did not answer") as caught:
            await receiver.receive("x")
        assert caught.value.phase == "id_release"


async def test_the_real_sender_answers_what_came_before_a_ping_first_except_an_active_rooms_abort() -> None:
    """The barrier's premise, against the real sender: a frame about a room it no longer holds is answered at
    once, so before the PONG of a PING sent after it; an ABORT of a room whose send() still runs is answered
    by that send() once its writes are over, maybe after the PONG: the receiver's ABORT hold covers that one."""
    async with running(CFG) as (sender, _), welcomed_receiver(sender.address, LAYOUT, CFG) as raw:
        raw.send(Abort(room="gone", reason="the client went away"))
        raw.send(Ping(nonce=1))
        assert isinstance(await raw.expect((AbortAck, Pong)), AbortAck)
        assert isinstance(await raw.expect(Pong), Pong)
        async with anyio.create_task_group() as tg:
            await _round_zero_in(sender, raw, tg)
            raw.send(Abort(room="x", reason="the client went away"))
            raw.send(Ping(nonce=2))
            # Either order (asyncio: the PONG first; trio may run the send() before reading the PING).
            answers = {type(await raw.expect((AbortAck, Pong))), type(await raw.expect((AbortAck, Pong)))}
            assert answers == {AbortAck, Pong}


async def test_a_room_aborted_by_both_sides_between_rounds_is_sent_again_at_once() -> None:
    """CI's scenario end to end, several times: the sender's abort() ends the room between rounds while the
    receiver cancels it too (every other time); the encoder and the receiver both retry the id at once.
    Nothing of the first attempt reaches the second: its rows are exact, no protocol violation."""
    cfg = CFG.replace(pool_tokens=4096, resume_reserve_tokens=128, copy_chunk_tokens=0)
    async with EmbeddingSender(LAYOUT, cfg, transport=MockTransport(faults=lambda call: WriteFault(delay=0.003))) \
            as s, EmbeddingReceiver(LAYOUT, cfg, connect=None, transport=MockTransport()) as r:
        received = 0
        for k in range(8):
            room = f"x{k % 3}"
            first_rows, second_rows = make_request(700, 2 * k), make_request(650, 2 * k + 1)
            async with anyio.create_task_group() as tg:
                async def first() -> None:
                    with suppress(TransferError):
                        await s.send(room, first_rows)  # noqa: B023  (awaited within the iteration)

                tg.start_soon(first)
                h = r.start(room, sender=s.address)
                with anyio.fail_after(5):
                    while h.status is not TransferStatus.TRANSFERRING and not h.done:
                        await anyio.lowlevel.checkpoint()
                for _ in range(k % 4):
                    await anyio.lowlevel.checkpoint()
                s.abort(room, "the encoder failed on the image")
                if k % 2:
                    h.cancel("the client went away")
                await h.wait()
            async with anyio.create_task_group() as tg:
                async def second() -> None:
                    with suppress(TransferError):
                        await s.send(room, second_rows)  # noqa: B023

                tg.start_soon(second)
                await anyio.sleep(0.01)
                again = await _start_when_allowed(r, room, sender=s.address)
                try:
                    got = await again.result()
                except TransferError as exc:  # e.g. its INIT came before the retried send(): told it was aborted
                    assert "protocol violation" not in str(exc), exc
                    s.abort(room, "given up")
                else:
                    assert_same(got.tensors, second_rows)
                    received += 1
        assert received > 0
        await wait_pools_free(s, r)


async def test_a_room_that_succeeded_holds_nothing() -> None:
    """Only a failure sends the barrier PING: after a success nothing of ours is left unanswered."""
    async with running(CFG) as (sender, [receiver]):
        src = make_request(300, 5)
        for _ in range(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "x", src)
                got = await receiver.receive("x")
            assert_same(got.tensors, src)
            assert all(len(c.held_ids) == 0 for c in receiver._conns.values())
            assert receiver.room_ids_held == {"abort_unanswered": 0, "barrier": 0}


async def _waiting_for_the_barrier(raw: RawSender, receiver: EmbeddingReceiver) -> ReceiveHandle:
    """Room "x" failed at the sender; a new attempt of it waits for the (held) barrier's PONG."""
    await _welcomed(raw)
    first = receiver.start("x")
    assert isinstance(await raw.expect(Init), Init)
    raw.send(Status(room="x", state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0,
                    error="the encoder failed"))
    await first.wait()
    await _barrier(raw, receiver)  # not answered
    again = receiver.start("x")
    await _no_init_within(raw, 0.1)
    return again


async def test_an_attempt_waiting_for_the_barrier_can_be_cancelled_and_sends_nothing() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        again = await _waiting_for_the_barrier(raw, receiver)
        assert receiver.room_ids_held == {"abort_unanswered": 0, "barrier": 1}
        again.cancel("the client went away")
        with anyio.fail_after(1):
            assert await again.wait() is TransferStatus.ABORTED
        with pytest.raises(TimeoutError):  # no ABORT, no PING: nothing of it reached the sender
            await raw.next(timeout=0.3)
        assert "x" not in receiver._connection(raw.address).rooms


async def test_an_attempt_waiting_for_the_barrier_opens_in_the_next_session_when_this_one_is_lost() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        again = await _waiting_for_the_barrier(raw, receiver)
        # The sender declares us dead: the session's holds go, the attempt opens in the next session.
        raw.send(Reject(reason="unknown peer: send HELLO first", room="x", code="unknown_peer"))
        raw.welcome(await raw.expect(Hello), CFG.heartbeat_interval)
        init = await raw.expect(Init)
        assert isinstance(init, Init) and init.room == "x" and not again.done
        again.cancel("test over")
        await again.wait()


async def test_an_attempt_waiting_for_the_barrier_ends_when_the_receiver_closes() -> None:
    async with raw_sender() as raw:
        receiver = EmbeddingReceiver(LAYOUT, CFG, connect=raw.address)
        async with receiver:
            waiting = await _waiting_for_the_barrier(raw, receiver)
            with anyio.fail_after(2):
                await receiver.aclose()
        assert waiting.done and waiting.status is TransferStatus.ABORTED


async def test_an_abort_the_sender_leaves_unanswered_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """A live sender answers an ABORT at once; one that answers heartbeats but not the ABORT keeps the id
    refused for the whole session: said once in a WARNING, not left to be found."""
    cfg = CFG.replace(heartbeat_interval=0.1, heartbeat_misses=3)
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, cfg, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), cfg.heartbeat_interval)  # PINGs answered by themselves
        handle = receiver.start("x")
        assert isinstance(await raw.expect(Init), Init)
        handle.cancel("the client went away")
        await handle.wait()
        assert isinstance(await raw.expect(Abort), Abort)
        with anyio.fail_after(5):
            while "has not answered our ABORT" not in caplog.text:
                await anyio.sleep(0.05)
        await anyio.sleep(0.5)
        assert caplog.text.count("has not answered our ABORT") == 1
        assert receiver.room_ids_held == {"abort_unanswered": 1, "barrier": 0}  # also a gauge (metrics)
        with pytest.raises(InvalidRequest, match="not yet acknowledged"):
            receiver.start("x")
