"""A receiver's ABORT that crosses the room's end on the wire is answered once, by the answer it waits for.

The receiver keeps a room id it aborted until the sender answers that ABORT (ABORT_ACK, or STATUS(fence=True)
while a write may still land): an answer arriving after the id was reused would reach the new attempt. CI
caught the race: the sender's ``abort()`` ended a room between rounds, the receiver's RESUME for the next round
and its ABORT crossed that end, the sender REJECTed the RESUME (a room it no longer had), the receiver took
that REJECT for the ABORT's answer and let the id go, and the real ABORT_ACK then failed the id's next attempt
("ABORT_ACK without an ABORT")."""

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
    Reject,
    Resume,
    Status,
    TransferStatus,
    Welcome,
)

from ..session.conftest import LAYOUT, make_request, running
from .rawpeer import raw_receiver, raw_sender

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=128, max_round_tokens=128, pool_tokens=4096, input_timeout=5.0,
                     round_timeout=5.0, handshake_timeout=2.0)


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


async def test_an_abort_ack_after_a_fence_status_does_not_fail_the_ids_next_attempt() -> None:
    """The room failed at the sender with a write that may still land (STATUS(fence=True)); the receiver's
    ABORT crossed it. That STATUS answers the ABORT here (the blocks stay fenced until FENCE_RELEASE); the
    sender, getting the ABORT after the write could no longer land, answers it with an ABORT_ACK too, which
    may reach the id's next attempt: ignored there, not taken for that attempt's protocol violation."""
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), CFG.heartbeat_interval)
        handle = receiver.start("x")
        assert isinstance(await raw.expect(Init), Init)
        handle.cancel("the client went away")
        await handle.wait()
        assert isinstance(await raw.expect(Abort), Abort)
        raw.send(Status(room="x", state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0,
                        error="a write failed and may still land", fence=True))
        raw.send(FenceRelease(room="x"))
        with anyio.fail_after(5):
            while True:
                try:
                    again = receiver.start("x")
                    break
                except InvalidRequest:  # fenced until FENCE_RELEASE and its settle time
                    await anyio.sleep(0.01)
        init = await raw.expect(Init)
        assert isinstance(init, Init) and init.room == "x"
        raw.send(AbortAck(room="x"))  # the answer to the first attempt's ABORT, sent after the release
        await anyio.sleep(0.3)
        assert again.status is TransferStatus.WAITING_FOR_INPUT and not again.done
        again.cancel("test over")
        await again.wait()
        assert isinstance(await raw.expect(Abort), Abort)
