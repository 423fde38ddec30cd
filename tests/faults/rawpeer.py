"""Raw protocol peers for fault tests: speak (or mangle) the wire protocol by hand."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import torch
import zmq
from anyio.streams.memory import MemoryObjectReceiveStream

from aioembed import Layout, TransferConfig
from aioembed.control.channel import ControlSocket
from aioembed.memory.pool import BlockPool
from aioembed.protocol.messages import Hello, Message, Ping, Pong, Welcome, decode, encode
from aioembed.transports.loopback import LoopbackTransport


class RawReceiver:
    """A DEALER that behaves like a receiver only as far as a test tells it to."""

    def __init__(self, chan: ControlSocket, inbox: MemoryObjectReceiveStream[list[bytes]],
                 transport: LoopbackTransport, pool: BlockPool) -> None:
        self.chan = chan
        self.inbox = inbox
        self.transport = transport
        self.pool = pool

    def send_raw(self, payload: bytes) -> None:
        self.chan.send([payload])

    def send(self, msg: Message) -> None:
        self.chan.send([encode(msg)])

    async def next(self, timeout: float = 5.0) -> Message:
        with anyio.fail_after(timeout):
            frames = await self.inbox.receive()
        return decode(frames[-1])

    async def expect(self, kind: type, timeout: float = 5.0) -> Message:
        """Skip PONGs etc. until a message of ``kind`` arrives."""
        with anyio.fail_after(timeout):
            while True:
                msg = await self.next(timeout)
                if isinstance(msg, kind):
                    return msg

    def hello(self, layout: Layout, config: TransferConfig, *, receiver_id: str = "raw-receiver", epoch: int = 1,
              rank: int = 0, world: int = 1) -> Hello:
        return Hello(receiver_id=receiver_id, epoch=epoch, fingerprint=layout.fingerprint,
                     transport=self.transport.name, descriptor=self.transport.descriptor(),
                     block_size=config.block_size, num_blocks=self.pool.num_blocks, rank=rank, world=world,
                     regions=tuple((r.address, r.length) for r in self.pool.regions()))


@asynccontextmanager
async def raw_receiver(address: str, layout: Layout, config: TransferConfig,
                       transport: LoopbackTransport | None = None) -> AsyncIterator[RawReceiver]:
    """A hand-driven receiver connected to ``address``, with a real pool registered with ``transport`` (default:
    a loopback one; a ``MockTransport`` for a sender that has one)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    send, recv = anyio.create_memory_object_stream[list[bytes]](10_000)
    chan = ControlSocket(sock, send.send_nowait, name="raw-receiver", bundles=True)
    transport = transport if transport is not None else await LoopbackTransport.open({})
    pool = BlockPool(layout, num_blocks=config.pool_blocks, block_size=config.block_size)
    await transport.register(pool.regions())
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(chan.run)
            yield RawReceiver(chan, recv, transport, pool)
            tg.cancel_scope.cancel()
    finally:
        chan.close()
        ctx.term()
        await transport.aclose()


@asynccontextmanager
async def welcomed_receiver(address: str, layout: Layout, config: TransferConfig) -> AsyncIterator[RawReceiver]:
    """:func:`raw_receiver`, already through the handshake: its HELLO answered by the sender's WELCOME."""
    async with raw_receiver(address, layout, config) as raw:
        raw.send(raw.hello(layout, config))
        welcome = await raw.expect(Welcome)
        assert isinstance(welcome, Welcome), welcome
        yield raw


class RawSender:
    """A ROUTER that plays the sender: it answers or stays silent as a test tells it.

    While ``pong`` is true it answers PINGs on its own (with ``peer_id``), like a live sender.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self.identity: bytes | None = None
        self.pong = True
        self.hold_pings = False
        """While true, PINGs go to the inbox instead: the test answers them (:meth:`pong_to`), after the frames
        a real sender would have answered first."""
        self.peer_id = "raw-sender"
        self.epoch = 0
        """The receiver session this raw sender knows (set by :meth:`welcome`), echoed in PONGs."""
        self.chan: ControlSocket
        self.inbox: MemoryObjectReceiveStream[list[bytes]]
        send, self.inbox = anyio.create_memory_object_stream[list[bytes]](10_000)
        self._forward = send

    def on_frames(self, frames: list[bytes]) -> None:
        try:
            msg = decode(frames[1])
        except Exception:
            msg = None
        if isinstance(msg, Ping) and not self.hold_pings:
            if self.pong:
                self.chan.send([frames[0], encode(Pong(nonce=msg.nonce, peer_id=self.peer_id, epoch=self.epoch))])
            return
        self._forward.send_nowait(frames)

    async def next(self, timeout: float = 5.0) -> Message:
        with anyio.fail_after(timeout):
            frames = await self.inbox.receive()
        self.identity = frames[0]
        return decode(frames[1])

    async def expect(self, kind: type, timeout: float = 5.0) -> Message:
        with anyio.fail_after(timeout):
            while True:
                msg = await self.next(timeout)
                if isinstance(msg, kind):
                    return msg

    def send(self, msg: Message) -> None:
        assert self.identity is not None
        self.chan.send([self.identity, encode(msg)])

    def pong_to(self, ping: Message) -> None:
        """Answer ``ping`` (a PING this raw sender received while holding them) like a live sender."""
        assert isinstance(ping, Ping)
        self.send(Pong(nonce=ping.nonce, peer_id=self.peer_id, epoch=self.epoch))

    def welcome(self, hello: Message, heartbeat_interval: float) -> Welcome:
        """Answer ``hello`` (a HELLO this raw sender received) with a WELCOME, like a real sender."""
        assert isinstance(hello, Hello)
        msg = Welcome(sender_id=self.peer_id, epoch=hello.epoch, heartbeat_interval=heartbeat_interval)
        self.epoch = hello.epoch
        self.send(msg)
        return msg

    def send_raw(self, payload: bytes) -> None:
        assert self.identity is not None
        self.chan.send([self.identity, payload])


@asynccontextmanager
async def raw_sender() -> AsyncIterator[RawSender]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    raw = RawSender(address)
    chan = raw.chan = ControlSocket(sock, raw.on_frames, name="raw-sender", routed=True, bundles=True)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(chan.run)
            yield raw
            tg.cancel_scope.cancel()
    finally:
        chan.close()
        ctx.term()


def pool_guard(pool: BlockPool) -> dict[str, torch.Tensor]:
    """A copy of the pool to compare with later (nothing may have been written)."""
    return {n: t.clone() for n, t in pool.tensors.items()}
