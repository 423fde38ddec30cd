"""A room that has not sent its INIT yet ends, or opens again, by the loss of the session it waits in, never by
the loss of an earlier one.

A second attempt of a room id waits, before anything else, for the sender's answer to the PING that followed the
first attempt's failure. A session lost meanwhile releases the id, and its ``SessionLost`` reaches the room, whose
wait for the id it does not cut short: it stayed in the room's inbox. The room then waited for memory in the next
session and, when that session was lost too, took the stale loss for it (found by a review): an earlier silence
failed with ``PeerDead`` a room that the later drop opens again, and an earlier drop opened again, to wait
``handshake_timeout`` for a sender gone silent, a room that should fail with ``PeerDead`` at once."""

from __future__ import annotations

import time

import anyio
import pytest

from aioembed import EmbeddingReceiver, PeerDead, TransferAborted, TransferConfig, TransferStatus
from aioembed.protocol.messages import Abort, Drained, Hello, Init, Reject
from aioembed.session.connection import SenderConnection
from aioembed.session.handle import ReceiveHandle

from ..session.conftest import LAYOUT
from .rawpeer import RawSender, raw_sender

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, resume_reserve_tokens=1024, heartbeat_interval=0.2,
                     heartbeat_misses=5, input_timeout=20.0, round_timeout=20.0, handshake_timeout=5.0)
SILENT_AFTER = CFG.heartbeat_interval * CFG.heartbeat_misses
HOLDER_TOKENS = CFG.pool_tokens - CFG.resume_reserve
"""A room of this many tokens leaves the pool only ``resume_reserve``: a first reservation waits behind it."""


def _unknown_peer(room: str) -> Reject:
    """What a sender that dropped the receiver's session answers about ``room``: the session is lost (DROPPED)."""
    return Reject(reason="unknown peer: send HELLO first", room=room, code="unknown_peer")


async def _expect_init(raw: RawSender, room: str) -> Init:
    init = await raw.expect(Init)
    assert isinstance(init, Init) and init.room == room, init
    return init


async def _expect_hello(raw: RawSender, timeout: float = 5.0) -> Hello:
    hello = await raw.expect(Hello, timeout=timeout)
    assert isinstance(hello, Hello), hello
    return hello


async def _second_attempt_waits_for_its_id(raw: RawSender, r: EmbeddingReceiver) -> tuple[ReceiveHandle,
                                                                                          ReceiveHandle]:
    """In the first session: room "X" ended by the sender's ABORT, after which the sender stops answering PINGs
    (the one after X's end included, so X's id stays held); room "Y" announced, holding the pool but its
    ``resume_reserve``. Returns Y and a second attempt of X, waiting for X's id (no INIT yet)."""
    raw.welcome(await raw.expect(Hello), CFG.heartbeat_interval)
    first = r.start("X")
    await _expect_init(raw, "X")
    raw.pong = False  # the sender freezes: from here on no PING is answered
    raw.send(Abort(room="X", reason="the encoder failed on the image"))
    with anyio.fail_after(5), pytest.raises(TransferAborted, match="the encoder failed on the image"):
        await first.result()
    holder = r.start("Y", expected_tokens=HOLDER_TOKENS)
    assert (await _expect_init(raw, "Y")).allocated_tokens == HOLDER_TOKENS
    again = r.start("X")
    conn = r._conns[raw.address]
    await anyio.sleep(0.05)
    assert conn.ready and "X" in conn.held_ids, "the first session must still hold X's id"
    assert again.status is TransferStatus.BOOTSTRAPPING and not again.done
    return holder, again


async def _memory_waiters(r: EmbeddingReceiver, conn: SenderConnection, n: int) -> None:
    """Until ``n`` first reservations wait for memory in the session now established."""
    with anyio.fail_after(5):
        while not (conn.ready and r.allocator.stats.waiters == n):
            await anyio.sleep(0.005)


async def test_an_earlier_silence_does_not_fail_a_room_that_a_later_drop_opens_again() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as r:
        holder, again = await _second_attempt_waits_for_its_id(raw, r)
        conn = r._conns[raw.address]
        # The first session is lost, silent: X's id is released, and X waits on for the next session.
        hello = await _expect_hello(raw, timeout=SILENT_AFTER + 5)
        with anyio.fail_after(5), pytest.raises(PeerDead, match="silent"):
            await holder.result()  # announced in it: its blocks stay fenced (silence proves nothing)
        raw.pong = True
        raw.welcome(hello, CFG.heartbeat_interval)
        await _memory_waiters(r, conn, 1)  # X, behind Y's fenced blocks
        raw.send(_unknown_peer("X"))  # the sender dropped the second session: X was never written, it opens again
        hello = await _expect_hello(raw)
        raw.welcome(hello, CFG.heartbeat_interval)
        raw.send(Drained(below_epoch=hello.epoch))  # Y's blocks were not written: X gets them
        with anyio.fail_after(5):
            while not (again.done or again.status is TransferStatus.WAITING_FOR_INPUT):
                await anyio.sleep(0.005)
        assert again.status is TransferStatus.WAITING_FOR_INPUT, again._error
        await _expect_init(raw, "X")  # announced in the third session
        assert conn.epoch == hello.epoch
        again.cancel("the test is over")
        assert await again.wait() is TransferStatus.ABORTED


async def test_an_earlier_drop_does_not_open_again_a_room_whose_sender_went_silent() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as r:
        holder, again = await _second_attempt_waits_for_its_id(raw, r)
        conn = r._conns[raw.address]
        raw.send(_unknown_peer("X"))  # the sender dropped the first session: X's id is released, Y opens again
        hello = await raw.expect(Hello)
        raw.welcome(hello, CFG.heartbeat_interval)  # still answering no PING: this session goes silent
        await _memory_waiters(r, conn, 2)  # X and Y, behind Y's first (fenced) blocks
        t0 = time.monotonic()
        with anyio.fail_after(SILENT_AFTER + CFG.handshake_timeout + 5):
            await again.wait()
        took = time.monotonic() - t0
        with pytest.raises(PeerDead, match="silent"):
            await again.result()
        # At once, not after a wait for a third handshake that never comes (handshake_timeout).
        assert took < CFG.handshake_timeout - 1.0
        with anyio.fail_after(5), pytest.raises(PeerDead, match="silent"):
            await holder.result()  # opened again after the drop: this silence fails it
