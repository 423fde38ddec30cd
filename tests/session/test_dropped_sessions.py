"""A sender lets go of a receiver's session once it ended: nothing of it (the session, its link, the regions it
announced) stays reachable. The liveness loop's loop variable kept the last session it looked at alive while the
loop slept, long after that session ended. The rooms the session had asked for end with it, and a later ``send()``
of one learns so at once."""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, PeerDead, TransferConfig, TransferStatus

from .conftest import LAYOUT, assert_same, make_request, room_goes_through, wait_pools_free

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=256, pool_tokens=4096, resume_reserve_tokens=256, heartbeat_interval=0.1,
                     heartbeat_misses=3, handshake_timeout=10.0)


async def test_a_session_that_ended_leaves_nothing_reachable() -> None:
    async with EmbeddingSender(LAYOUT, CFG) as s:
        gone = []
        for i in range(2):
            async with EmbeddingReceiver(LAYOUT, CFG, connect=s.address) as r:
                await r.wait_connected()
                await room_goes_through(s, r, f"room{i}", 300, seed=i)
                (session,) = s._peers.sessions()
                gone.append((weakref.ref(session), weakref.ref(session.link)))
                del session
            with anyio.fail_after(10):
                while s.peers or s.writes_in_flight:  # the receiver went silent: its session ends
                    await anyio.sleep(0.02)
        await anyio.sleep(3 * CFG.heartbeat_interval)  # the liveness loop looked again, and sleeps
        gc.collect()
        assert [(session(), link()) for session, link in gone] == [(None, None)] * 2


async def test_a_room_whose_session_ended_is_sent_once_its_receiver_back_asks_again() -> None:
    """The receiver asked for a room, then lost its sender's session (its application declared the sender gone:
    the room failed there, and the receiver shook hands again, which ends the old session on the sender too). The
    sender keeps the room's end; but with the receiver back, a ``send()`` of the room waits for its INIT as for any
    room (it may be asked again), and the receiver's retry of the id is served, with this ``send()``'s rows."""
    cfg = CFG.replace(input_timeout=10.0)
    async with EmbeddingSender(LAYOUT, cfg) as s, EmbeddingReceiver(LAYOUT, cfg, connect=s.address) as r:
        await r.wait_connected()
        handle = r.start("room")
        with anyio.fail_after(5):
            while s.rooms_in_flight == 0:
                await anyio.sleep(0.01)
        r.declare_sender_gone()
        with anyio.fail_after(5):
            with pytest.raises(PeerDead, match="declared gone"):
                await handle.result()
            while s.rooms_in_flight or not s.peers:  # the new session replaced the old one; the room ended
                await anyio.sleep(0.01)
        assert handle.status is TransferStatus.FAILED and "room" in s._ended
        src = make_request(300, 2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.send, "room", src)
            with anyio.fail_after(5):
                while s.rooms_in_flight == 0:  # send() waits for an INIT (the receiver is back)
                    await anyio.sleep(0.01)
                await anyio.sleep(0.1)
                got = await r.receive("room")
        assert_same(got.tensors, src)
        await wait_pools_free(s, r)
