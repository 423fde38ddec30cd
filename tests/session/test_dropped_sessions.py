"""A sender lets go of a receiver's session once it ended: nothing of it (the session, its link, the regions it
announced) stays reachable. The liveness loop's loop variable kept the last session it looked at alive while the
loop slept, long after that session ended."""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferConfig

from .conftest import LAYOUT, room_goes_through

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
