"""The control channel: one peer at its high-water mark neither blocks frames to the others nor makes
the I/O task spin."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import zmq

from aioembed.control.channel import ControlSocket

pytestmark = pytest.mark.anyio

FRAME = b"x" * (64 << 10)


@asynccontextmanager
async def router_with_two_peers() -> AsyncIterator[tuple[ControlSocket, zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 4), (zmq.SNDBUF, 65536), (zmq.ROUTER_MANDATORY, 1)):
        router.setsockopt(opt, value)
    router.bind("tcp://127.0.0.1:0")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    peers = []
    for name in (b"stuck", b"healthy"):
        d = ctx.socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.RCVHWM, 4), (zmq.RCVBUF, 65536), (zmq.ROUTING_ID, name)):
            d.setsockopt(opt, value)
        d.connect(address)
        peers.append(d)
    hello: list[bytes] = []
    chan = ControlSocket(router, lambda frames: hello.append(frames[0]), name="test-router", routed=True)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(chan.run)
            for d in peers:
                d.send(b"hi")  # the router learns both identities
            with anyio.fail_after(5):
                while len(hello) < 2:
                    await anyio.sleep(0.01)
            yield chan, peers[0], peers[1]
            tg.cancel_scope.cancel()
    finally:
        chan.close()
        for d in peers:
            d.close(linger=0)
        ctx.term()


def _recv_all(sock: zmq.Socket[bytes]) -> int:
    n = 0
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return n
        n += 1


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_a_peer_at_its_high_water_mark_blocks_nobody_and_nothing_spins() -> None:
    async with router_with_two_peers() as (chan, stuck, healthy):
        for _ in range(300):  # far more than HWM + socket buffers: the stuck peer never reads
            chan.send([b"stuck", FRAME])
        await anyio.sleep(0.3)
        assert chan.blocked_peers == 1 and chan.queued > 0
        for _ in range(100):
            chan.send([b"healthy", b"small"])
        got = 0
        with anyio.fail_after(5):
            while got < 100:
                got += _recv_all(healthy)
                await anyio.sleep(0.01)
        # While the stuck peer stays stuck, the I/O task sleeps between retries: no busy loop.
        cpu0, wall0 = time.process_time(), time.monotonic()
        await anyio.sleep(2.0)
        cpu = time.process_time() - cpu0
        assert cpu < 0.4 * (time.monotonic() - wall0), f"{cpu:.2f} CPU-s in 2 s: the I/O task spins"
        assert chan.blocked_peers == 1
        # Once it reads, everything queued for it arrives, in order, and the outbox drains.
        received = 0
        with anyio.fail_after(20):
            while received < 300:
                received += _recv_all(stuck)
                await anyio.sleep(0.005)
            await chan.drain()
        assert chan.queued == 0 and chan.blocked_peers == 0


async def test_the_outbox_limit_is_per_peer() -> None:
    from aioembed.errors import AioembedError

    async with router_with_two_peers() as (chan, _stuck, healthy):
        chan._max_outbox = 50
        with pytest.raises(AioembedError, match="not reading"):
            for _ in range(500):
                chan.send([b"stuck", FRAME])
        chan.send([b"healthy", b"still fine"])  # another peer is not refused
        with anyio.fail_after(5):
            while not _recv_all(healthy):
                await anyio.sleep(0.01)
