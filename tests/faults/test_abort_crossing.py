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
import pytest

from aioembed import EmbeddingReceiver, TransferConfig, TransferError
from aioembed.errors import InvalidRequest
from aioembed.protocol.messages import (
    Abort,
    AbortAck,
    FenceRelease,
    Hello,
    Init,
    Ping,
    Reject,
    Resume,
    Status,
    TransferStatus,
    Welcome,
)

from ..session.conftest import LAYOUT, make_request, running
from .rawpeer import RawSender, raw_receiver, raw_sender

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=128, max_round_tokens=128, pool_tokens=4096, input_timeout=5.0,
                     round_timeout=5.0, handshake_timeout=2.0, heartbeat_interval=30.0)
"""No heartbeat PING while a test holds PINGs to answer them itself (the first goes out at the handshake)."""


async def test_a_resume_that_crossed_the_senders_abort_is_ignored_and_the_abort_answered() -> None:
    async with running(CFG) as (sender, _), raw_receiver(sender.address, LAYOUT, CFG) as raw:
        raw.send(raw.hello(LAYOUT, CFG))
        assert isinstance(await raw.expect(Welcome), Welcome)
        async with anyio.create_task_group() as tg:
            async def send() -> None:
                with suppress(TransferError):
                    await sender.send("x", make_request(300, 1))

            raw.send(Init(room="x", blocks=(0,), allocated_tokens=128, expected_ranks=1))
            tg.start_soon(send)
            first = await raw.expect(Status)
            assert isinstance(first, Status) and first.state is TransferStatus.TRANSFERRING and first.round == 0
            sender.abort("x", "the encoder failed on the image")  # the room waits for this rank's RESUME
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
        with anyio.fail_after(5):
            while True:
                try:
                    again = receiver.start("x")
                    break
                except InvalidRequest:
                    await anyio.sleep(0.01)
        init = await raw.expect(Init)
        assert isinstance(init, Init) and init.room == "x"
        again.cancel("test over")
        await again.wait()



async def _welcomed(raw: RawSender) -> None:
    raw.welcome(await raw.expect(Hello), CFG.heartbeat_interval)
    await anyio.sleep(0.05)  # the handshake's first heartbeat PING is answered by itself
    raw.hold_pings = True


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
        barrier = await raw.expect(Ping)
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
        await _welcomed(raw)
        first = receiver.start("x")
        assert isinstance(await raw.expect(Init), Init)
        first.cancel("the client went away")
        await first.wait()
        assert isinstance(await raw.expect(Abort), Abort)
        barrier = await raw.expect(Ping)
        raw.send(Status(room="x", state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0,
                        error="a write failed and may still land", fence=True))
        raw.send(FenceRelease(room="x"))
        with anyio.fail_after(5):
            while True:
                try:
                    again = receiver.start("x")  # once the fence is released and settled
                    break
                except InvalidRequest:
                    await anyio.sleep(0.01)
        await _no_init_within(raw, 0.3)
        raw.send(AbortAck(room="x"))
        raw.pong_to(barrier)
        assert isinstance(await raw.expect(Init), Init)
        await anyio.sleep(0.2)
        assert again.status is TransferStatus.WAITING_FOR_INPUT and not again.done
        again.cancel("test over")
        await again.wait()


async def test_an_abort_ack_after_a_fence_release_frees_the_failed_writes_blocks_only_after_the_settle() -> None:
    """FENCE_RELEASE frees blocks a failed write may reach FENCE_SETTLE later (bytes already in our socket
    buffers land meanwhile); the ABORT_ACK right behind it, sent for the same reason, freed them at once."""
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        await _welcomed(raw)
        first = receiver.start("x")
        assert isinstance(await raw.expect(Init), Init)
        first.cancel("the client went away")
        await first.wait()
        assert isinstance(await raw.expect(Abort), Abort)
        raw.pong_to(await raw.expect(Ping))
        conn = receiver._connection(raw.address)
        raw.send(Status(room="x", state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0,
                        error="a write failed and may still land", fence=True))
        raw.send(FenceRelease(room="x"))
        raw.send(AbortAck(room="x"))
        await anyio.sleep(0.05)
        assert receiver.keeper.ledger.holds_room(conn.writer, "x")
        with anyio.fail_after(5):
            while receiver.keeper.ledger.holds_room(conn.writer, "x"):
                await anyio.sleep(0.01)
        assert receiver.fenced_blocks == {}


async def test_abort_after_a_failed_send_keeps_the_ranks_that_asked() -> None:
    """``abort()`` after ``send()`` raised (a common ``except`` clause) rewrote the room's tombstone without
    its ranks: a RESUME of theirs that crossed the end was REJECTed again, not ignored."""
    async with running(CFG) as (sender, _), raw_receiver(sender.address, LAYOUT, CFG) as raw:
        raw.send(raw.hello(LAYOUT, CFG))
        assert isinstance(await raw.expect(Welcome), Welcome)
        async with anyio.create_task_group() as tg:
            async def send() -> None:
                with suppress(TransferError):
                    await sender.send("x", make_request(300, 1))

            raw.send(Init(room="x", blocks=(0,), allocated_tokens=128, expected_ranks=1))
            tg.start_soon(send)
            assert isinstance(await raw.expect(Status), Status)
            sender.abort("x", "the encoder failed on the image")
            end = await raw.expect(Status)
            assert isinstance(end, Status) and end.state is TransferStatus.ABORTED
        sender.abort("x", "the application aborts it again after send() raised")
        raw.send(Resume(room="x", round=1, sent_tokens=128, blocks=(1,), allocated_tokens=128))
        raw.send(Abort(room="x", reason="the client went away"))
        answer = await raw.expect((AbortAck, Reject))
        assert isinstance(answer, AbortAck) and answer.room == "x"
