"""A control connection that stays open while nothing comes through it (a half-open TCP connection).

A sender's host that vanishes without a FIN (a node lost, a pod rescheduled elsewhere behind the same name)
leaves the receiver's TCP connection open: its kernel retransmits what the receiver says into it for about
15 minutes before it gives up, and ZeroMQ reconnects (and resolves the name again) only then. A receiver
that found the sender silent must not keep saying HELLO into that connection: it reconnects, so a sender
started again at the address is served within seconds.

The tests put a TCP proxy between the two sides that can turn the connections it holds into black holes
(open, every byte swallowed, as a host that is gone without a word) while it forwards new connections to
another sender.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import anyio
import anyio.abc
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, PeerDead, TransferConfig
from aioembed.control.address_probe import ProbeVerdict
from aioembed.metrics import TransferObserver
from aioembed.transports.loopback import LoopbackTransport

from ..session.conftest import LAYOUT, room_goes_through

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, heartbeat_interval=0.1, heartbeat_misses=3,
                     handshake_timeout=5.0, input_timeout=8.0)


class BlackHoleProxy:
    """Forwards each TCP connection to the sender at ``target``; :meth:`cut` turns the connections open so
    far into black holes, :meth:`vanish` also stops listening (nothing answers at the address any more)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.address = ""
        self._era = 0
        self._listener: anyio.abc.SocketListener | None = None

    def cut(self, target: str) -> None:
        """Swallow everything on the connections open now (kept open); new ones go to ``target``."""
        self._era += 1
        self.target = target

    async def vanish(self) -> None:
        """:meth:`cut`, and new connections are refused: the host of the sender is gone, its address empty."""
        self.cut(self.target)
        assert self._listener is not None
        await self._listener.aclose()

    async def _pump(self, src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream, era: int) -> None:
        try:
            async for chunk in src:
                if era == self._era:
                    await dst.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            if era == self._era:  # a black hole keeps the other side open
                await dst.aclose()

    async def _serve_one(self, client: anyio.abc.SocketStream) -> None:
        era = self._era
        host, port = self.target.removeprefix("tcp://").rsplit(":", 1)
        async with client, await anyio.connect_tcp(host, int(port)) as upstream:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream, era)
                tg.start_soon(self._pump, upstream, client, era)

    async def _serve(self, task_group: anyio.abc.TaskGroup) -> None:
        assert self._listener is not None
        with suppress(anyio.ClosedResourceError):  # vanish() closed it
            while True:
                task_group.start_soon(self._serve_one, await self._listener.accept())

    @asynccontextmanager
    async def running(self) -> AsyncIterator[BlackHoleProxy]:
        self._listener = (await anyio.create_tcp_listener(local_host="127.0.0.1")).listeners[0]
        port = self._listener.extra(anyio.abc.SocketAttribute.local_port)
        self.address = f"tcp://127.0.0.1:{port}"
        async with self._listener, anyio.create_task_group() as tg:
            tg.start_soon(self._serve, tg)
            yield self
            tg.cancel_scope.cancel()


class _NonRevocable(LoopbackTransport):
    capabilities = dataclasses.replace(LoopbackTransport.capabilities, revocable=False, orphan_lifetime=0.3)


class _Probes(TransferObserver):
    def __init__(self) -> None:
        self.verdicts: list[str] = []
        self.proofs: set[str] = set()

    def disconnect_probed(self, *, sender: str, verdict: str) -> None:
        self.verdicts.append(verdict)

    def fence_released(self, *, proof: str, blocks: int, sender: str) -> None:
        self.proofs.add(proof)


async def test_a_receiver_that_found_its_sender_silent_reconnects_and_a_new_sender_there_serves_it() -> None:
    async with EmbeddingSender(LAYOUT, CFG) as first, EmbeddingSender(LAYOUT, CFG) as second:
        async with BlackHoleProxy(first.address).running() as proxy:
            async with EmbeddingReceiver(LAYOUT, CFG, connect=proxy.address) as receiver:
                await room_goes_through(first, receiver, "before", 300, 1)
                proxy.cut(second.address)  # the first sender's host is gone without a word
                # Silent after 0.3 s; reconnected, the receiver reaches the sender now at the address. (Saying HELLO
                # into the dead connection, it reached nobody until its kernel gave up, minutes later.)
                await second.wait_for_receivers(1, timeout=10)
                await room_goes_through(second, receiver, "after", 1500, 2)


async def test_a_silent_sender_whose_address_then_refuses_is_found_gone_though_its_connection_never_dropped(
) -> None:
    """The reconnect stands for the drop that the dead connection's kernel reports only minutes later: the
    sender's address is asked at once, and its refusal proves the process gone (the blocks it may still have
    written come back after the transport's orphan lifetime). Without it, nothing asked while the dead
    connection stayed open, and the blocks stayed fenced. (The proxy plays the sender's host: receivers are to
    name a sender's own address, not a proxy's.)"""
    probes = _Probes()
    async with EmbeddingSender(LAYOUT, CFG) as first:
        async with BlackHoleProxy(first.address).running() as proxy:
            async with EmbeddingReceiver(LAYOUT, CFG, connect=proxy.address, observer=probes,
                                         transport=_NonRevocable()) as receiver:
                await receiver.wait_connected(timeout=5)
                handle = receiver.start("announced")
                with anyio.fail_after(5):
                    while not first.rooms_in_flight:  # its INIT (blocks announced) arrived
                        await anyio.sleep(0.01)
                await proxy.vanish()
                with pytest.raises(PeerDead):
                    await handle.result()
                with anyio.fail_after(10):
                    while receiver.allocator.stats.fenced:
                        await anyio.sleep(0.05)
                assert ProbeVerdict.REFUSED.value in probes.verdicts, probes.verdicts
                assert probes.proofs == {"writer_gone"}  # fenced until then: silence proves nothing
                stats = receiver.allocator.stats
                assert stats.free == stats.total
