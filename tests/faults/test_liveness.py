"""Liveness and restarts: a silent peer is declared dead, its rooms end with the reason, its blocks
are released; blocks a live peer may still write stay fenced; a restarted sender is used at once."""

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
from aioembed.protocol.messages import Abort, AbortAck, Init, Status, Welcome

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


async def test_silent_sender_is_declared_dead_and_blocks_are_released() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, HB, connect=raw.address) as receiver:
        await raw.next()  # HELLO
        raw.send(Welcome(peer_id=raw.peer_id, heartbeat_interval=HB.heartbeat_interval))
        handle = receiver.start("r")
        assert isinstance(await raw.expect(Init), Init)
        assert receiver.allocator.stats.used > 0
        raw.pong = False  # the sender hangs
        t0 = time.monotonic()
        with pytest.raises(PeerDead, match="silent"):
            await handle.result()
        assert time.monotonic() - t0 < DEAD_WITHIN
        assert _free(receiver)


async def test_protocol_violation_by_sender_aborts_and_frees_after_ack() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, HB, connect=raw.address) as receiver:
        await raw.next()
        raw.send(Welcome(peer_id=raw.peer_id, heartbeat_interval=HB.heartbeat_interval))
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


async def test_unacknowledged_abort_keeps_blocks_fenced_until_the_sender_is_dead() -> None:
    cfg = HB.replace(round_timeout=0.3)
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, cfg, connect=raw.address) as receiver:
        await raw.next()
        raw.send(Welcome(peer_id=raw.peer_id, heartbeat_interval=cfg.heartbeat_interval))
        handle = receiver.start("r")
        await raw.expect(Init)
        handle.cancel("give up")
        await raw.expect(Abort)
        assert await handle.wait() is TransferStatus.ABORTED
        await anyio.sleep(0.5)  # past round_timeout without an ABORT_ACK
        st = receiver.allocator.stats
        assert st.fenced > 0 and st.free < st.total  # never handed to another room while unsafe
        raw.pong = False
        with anyio.fail_after(DEAD_WITHIN):
            while not _free(receiver):
                await anyio.sleep(0.02)


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
                while not first._closed:
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
