"""Liveness and restarts: a silent peer is declared dead and its rooms end with the reason, but its
blocks stay fenced (silence proves nothing about the data plane) until the sender confirms, in a
later session, that its writes ended (DRAINED); a restarted sender is used at once."""

from __future__ import annotations

import time

import anyio
import anyio.abc
import pytest

from aioembed import (
    EmbeddingReceiver,
    EmbeddingSender,
    PeerDead,
    TransferConfig,
    TransferFailed,
    TransferStatus,
)
from aioembed.protocol.messages import Abort, AbortAck, Drained, Hello, Init, Progress, Reject, Status, Welcome

from ..session.conftest import LAYOUT, assert_same, make_request
from .rawpeer import raw_receiver, raw_sender

pytestmark = pytest.mark.anyio

HB = TransferConfig(default_tokens=1024, pool_tokens=4096, heartbeat_interval=0.2, heartbeat_misses=3,
                    input_timeout=20.0, round_timeout=20.0, handshake_timeout=2.0)
DEAD_WITHIN = HB.heartbeat_interval * (HB.heartbeat_misses + 2) + 1.0


def _free(receiver: EmbeddingReceiver) -> bool:
    st = receiver.allocator.stats
    return st.free == st.total and st.fenced == 0


async def test_silent_receiver_is_declared_dead_and_send_fails() -> None:
    async with EmbeddingSender(LAYOUT, HB) as sender, raw_receiver(sender.address, LAYOUT, HB) as raw:
        raw.send(raw.hello(LAYOUT, HB))
        await raw.expect(Welcome)
        raw.send(Init(room="r", blocks=(0, 1), allocated_tokens=200, expected_ranks=1))
        t0 = time.monotonic()
        with pytest.raises(PeerDead, match="silent"):
            await sender.send("r", make_request(5000, 1))  # first round written, then nobody resumes
        assert time.monotonic() - t0 < DEAD_WITHIN
        assert sender.rooms_in_flight == 0 and sender.peers == []


def _fenced(receiver: EmbeddingReceiver) -> bool:
    st = receiver.allocator.stats
    return st.fenced > 0 and st.free < st.total


async def test_silent_sender_fails_the_room_but_its_blocks_stay_fenced_until_it_confirms() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, HB, connect=raw.address) as receiver:
        hello = await raw.expect(Hello)
        raw.welcome(hello, HB.heartbeat_interval)
        handle = receiver.start("r")
        assert isinstance(await raw.expect(Init), Init)
        assert receiver.allocator.stats.used > 0
        raw.pong = False  # the sender hangs: a write of it may still be on its way
        t0 = time.monotonic()
        with pytest.raises(PeerDead, match="silent"):
            await handle.result()
        assert time.monotonic() - t0 < DEAD_WITHIN
        assert _fenced(receiver) and receiver.fenced_blocks == {"peer_silent": receiver.allocator.stats.fenced}
        await anyio.sleep(1.0)
        assert _fenced(receiver)  # silence never frees: a frozen sender writes on when it thaws
        # The sender thaws: the receiver's new session reaches it, it confirms the old one is drained.
        raw.pong = True
        hello2 = await raw.expect(Hello, timeout=5)
        assert isinstance(hello2, Hello) and hello2.epoch == 2 and hello2.receiver_id == hello.receiver_id
        raw.welcome(hello2, HB.heartbeat_interval)
        raw.send(Drained(below_epoch=1))  # says nothing about session 1: nothing freed
        await anyio.sleep(0.5)
        assert _fenced(receiver)
        raw.send(Drained(below_epoch=2))
        with anyio.fail_after(2):
            while not _free(receiver):
                await anyio.sleep(0.01)


async def test_protocol_violation_by_sender_aborts_and_frees_after_ack() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, HB, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), HB.heartbeat_interval)
        handle = receiver.start("r")
        init = await raw.expect(Init)
        assert isinstance(init, Init)
        # claims more tokens than were reserved
        raw.send(Status(room="r", state="TRANSFERRING", total_tokens=9000, sent_tokens=init.allocated_tokens + 1,
                        round=0))
        abort = await raw.expect(Abort)
        assert isinstance(abort, Abort) and abort.room == "r"
        assert receiver.allocator.stats.fenced > 0  # visible while the sender may still write
        raw.send(AbortAck(room="r"))
        with pytest.raises(TransferFailed, match="protocol violation"):
            await handle.result()
        with anyio.fail_after(2):
            while not _free(receiver):
                await anyio.sleep(0.01)


async def test_unacknowledged_abort_keeps_blocks_fenced_until_a_late_ack() -> None:
    cfg = HB.replace(round_timeout=0.3)
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, cfg, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), cfg.heartbeat_interval)
        handle = receiver.start("r")
        await raw.expect(Init)
        handle.cancel("give up")
        await raw.expect(Abort)
        assert await handle.wait() is TransferStatus.ABORTED  # the room ends at once...
        await anyio.sleep(0.5)
        assert _fenced(receiver)  # ...but its blocks are never handed to another room while unsafe
        assert receiver.fenced_blocks == {"abort_unacked": receiver.allocator.stats.fenced}
        raw.send(AbortAck(room="r"))  # the sender's writes into them ended
        with anyio.fail_after(2):
            while not _free(receiver):
                await anyio.sleep(0.01)


async def test_unacknowledged_abort_stays_fenced_through_silence_until_drained() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, HB, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), HB.heartbeat_interval)
        handle = receiver.start("r")
        await raw.expect(Init)
        handle.cancel("give up")
        await raw.expect(Abort)
        raw.pong = False
        await anyio.sleep(DEAD_WITHIN)  # the sender is declared dead meanwhile
        assert _fenced(receiver)
        raw.pong = True
        hello = await raw.expect(Hello, timeout=5)
        raw.welcome(hello, HB.heartbeat_interval)
        raw.send(Drained(below_epoch=hello.epoch))  # type: ignore[union-attr]
        with anyio.fail_after(2):
            while not _free(receiver):
                await anyio.sleep(0.01)


async def test_restarted_sender_serves_new_rooms_at_once() -> None:
    stop = anyio.Event()

    async def serve(bind: str, *, task_status: anyio.abc.TaskStatus[EmbeddingSender]) -> None:
        async with EmbeddingSender(LAYOUT, HB, bind=bind) as s:
            task_status.started(s)
            await stop.wait()

    async with anyio.create_task_group() as tg:
        first = await tg.start(serve, "tcp://127.0.0.1:0")
        address = first.address
        async with EmbeddingReceiver(LAYOUT, HB, connect=address) as receiver:
            src = make_request(3000, 1)
            async with anyio.create_task_group() as inner:
                inner.start_soon(first.send, "before", src)
                got = await receiver.receive("before")
            assert_same(got.tensors, src)
            stop.set()  # the first sender goes away
            with anyio.fail_after(5):
                while not first._closed.is_set():
                    await anyio.sleep(0.01)
            stop = anyio.Event()
            second = await tg.start(serve, address)  # restarted on the same address
            t0 = time.monotonic()
            src2 = make_request(2500, 2)
            async with anyio.create_task_group() as inner:
                inner.start_soon(second.send, "after", src2)
                got2 = await receiver.receive("after")
            assert_same(got2.tensors, src2)
            assert time.monotonic() - t0 < 3.0  # no stale-connection timeout
            assert _free(receiver)
            stop.set()


async def test_a_stream_that_handed_out_rows_fails_when_its_session_drops_instead_of_starting_over() -> None:
    """A room whose rows came by PROGRESS (a stream handed them out) and whose sender then dropped the session
    was treated as having received nothing and opened again from token 0: the stream would see chunk 0 a
    second time (found by a review). It fails now, naming the rows it delivered."""
    cfg = HB.replace(stream_chunk_tokens=256)
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, cfg, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), cfg.heartbeat_interval)
        async with receiver.stream("r") as stream:
            init = await raw.expect(Init)
            assert isinstance(init, Init) and init.progress_tokens == 256
            raw.send(Progress(room="r", round=0, sent_tokens=256, total_tokens=900, metadata={}))
            chunk = await stream.__anext__()
            assert (chunk.start, chunk.end) == (0, 256)
            raw.send(Reject(reason="unknown peer: send HELLO first", room="r", code="unknown_peer"))
            with anyio.fail_after(5), pytest.raises(PeerDead) as err:
                await stream.__anext__()
            assert err.value.delivered == (0, 256)
