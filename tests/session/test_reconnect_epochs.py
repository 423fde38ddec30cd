"""A receiver's handshake epochs grow across its connections to one sender.

A connection closes when idle (``sender_idle_timeout``) or is evicted (``max_senders``) while the sender
still holds its session until heartbeats time out. A new connection that started again at session 1
was ignored by the sender as older than the session it held, and the room waited ``handshake_timeout``."""

from __future__ import annotations

import anyio
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferConfig
from aioembed.session.connection import LossKind

from .conftest import LAYOUT, assert_same, make_request

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=256, pool_tokens=4096, resume_reserve_tokens=256, sender_idle_timeout=0.3,
                     heartbeat_interval=1.0, heartbeat_misses=5, handshake_timeout=10.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_new_connection_after_an_idle_close_is_served_at_once() -> None:
    async with EmbeddingSender(LAYOUT, CFG) as s, EmbeddingReceiver(LAYOUT, CFG) as r:
        src = make_request(300, 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.send, "a", src)
            await r.receive("a", sender=s.address)
        conn = r._conns[s.address]
        conn.session_lost(LossKind.SILENT, "the sender went silent for a while")  # a second session follows
        with anyio.fail_after(5):
            while not (conn.ready and conn.epoch > 1):
                await anyio.sleep(0.01)
        held = conn.epoch
        with anyio.fail_after(5):
            while s.address in r.senders:  # the connection closes when idle; the sender still holds its session
                await anyio.sleep(0.01)
        with anyio.fail_after(5):  # well within handshake_timeout: the new connection's HELLO is answered
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.send, "b", src)
                got = await r.receive("b", sender=s.address)
        assert_same(got.tensors, src)
        assert r._conns[s.address].epoch > held
