"""The control floor: the raw transfer framed by the two control messages aioembed's protocol puts on the
critical path of every room.

A receiver-driven transfer, as aioembed's is, says two things before the rows may be read: the receiver's
request reaches the sender (where to write), and the sender's "done" reaches the receiver. The floor times
exactly that around the raw baseline's transfer, with plain pyzmq and nothing else:

1. an untimed ``prime`` from here asks the *floor peer* (a bare child process, :mod:`aioembed.bench.floor_peer`,
   blocked in ``zmq_poll``) to begin; it reads the clock (``t0``) and sends ``ask``;
2. here, woken by ``ask``, the raw transfer runs, then ``done`` goes out;
3. the peer, woken by ``done``, reads the clock (``t1``) and answers both readings (untimed).

``t1 - t0`` (both read in the peer) is the raw transfer plus one hop each way, the wake-ups of idle threads
included, which on small VMs are most of a hop. ``raw / floor`` is what a transfer of this protocol's shape
would reach if it moved the data as the raw method does and spent nothing else: a reference point for
aioembed's own cost, not a bound on every design. A data path faster than the raw method passes it (over
Mooncake, aioembed's split batches beat one ``batch_transfer_sync_write``), and other shapes need fewer
messages (a pull by one-sided reads, blocks granted ahead of time). The peer side blocks (the cheapest
wake-up there is); this side waits on the socket's FD in the event loop, as any asyncio or trio program would.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NoReturn

import anyio
import zmq

from aioembed.bench.baselines import BaselinePeer
from aioembed.bench.floor_peer import ASK, DONE, PRIME, TIMES
from aioembed.errors import TransportError

__all__ = ["ControlFloor"]

_PEER_FILE = str(Path(__file__).with_name("floor_peer.py"))


class ControlFloor:
    """Times ``transfer`` between the two control hops described above; ``start`` once, ``aclose`` after.
    ``timeout`` bounds each wait for the peer's answer (its start-up gets ``START_TIMEOUT``)."""

    START_TIMEOUT = 60.0

    def __init__(self, timeout: float = 60.0) -> None:
        self._timeout = timeout
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._peer = BaselinePeer("control floor")

    async def start(self) -> None:
        self._ctx = zmq.Context()
        sock = self._sock = self._ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        try:
            await self._peer.start_file(_PEER_FILE, {"address": f"tcp://127.0.0.1:{port}"}, self.START_TIMEOUT)
        except TimeoutError:
            raise TransportError(f"control floor: the floor peer did not say it was ready within "
                                 f"START_TIMEOUT={self.START_TIMEOUT} s; its stderr ends with: "
                                 f"{self._peer.stderr_tail()!r}") from None
        # one exchange before any timing, so the TCP connection is up
        await self.time(anyio.lowlevel.checkpoint)

    async def time(self, transfer: Callable[[], Awaitable[None]]) -> float:
        """Seconds from the peer's request to the peer holding ``done``, ``transfer`` run in between."""
        t0, t1 = await self.span(transfer)
        return t1 - t0

    async def span(self, transfer: Callable[[], Awaitable[None]]) -> tuple[float, float]:
        """When (``time.monotonic``, read in the peer) the request left and ``done`` arrived."""
        sock = self._sock
        if sock is None:
            raise TransportError("control floor: start() was not called")
        await self._send(sock, PRIME)
        got = await self._recv(sock)
        if got != ASK:
            raise TransportError(f"control floor: expected {ASK!r} from the floor peer, got {got[:32]!r}")
        await transfer()  # its own errors, a TimeoutError included, are its own
        await self._send(sock, DONE)
        reply = await self._recv(sock)
        if len(reply) != TIMES.size:
            raise TransportError(f"control floor: expected two clock readings ({TIMES.size} bytes) from the floor "
                                 f"peer, got {reply[:32]!r}")
        t0, t1 = TIMES.unpack(reply)
        return float(t0), float(t1)

    async def _send(self, sock: zmq.Socket[bytes], msg: bytes) -> None:
        """Hand ``msg`` to ZeroMQ; only before the peer's connection is up does it wait (for ``POLLOUT``)."""
        with anyio.move_on_after(self._timeout):
            while True:
                try:
                    sock.send(msg, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    await self._wait(sock, zmq.POLLOUT)
        self._silent(f"take {msg!r}")

    async def _recv(self, sock: zmq.Socket[bytes]) -> bytes:
        with anyio.move_on_after(self._timeout):
            while True:
                try:
                    return sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    await self._wait(sock, zmq.POLLIN)
        self._silent("answer")

    def _silent(self, what: str) -> NoReturn:
        raise TransportError(f"control floor: the floor peer did not {what} within {self._timeout} s; its stderr "
                             f"ends with: {self._peer.stderr_tail()!r}")

    @staticmethod
    async def _wait(sock: zmq.Socket[bytes], event: int) -> None:
        """Wait for ``event``: on ZeroMQ's edge-triggered FD, and only after ``zmq.EVENTS`` says it is not there."""
        if not int(sock.get(zmq.EVENTS)) & event:
            await anyio.wait_readable(int(sock.get(zmq.FD)))

    async def aclose(self) -> None:
        await self._peer.aclose()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
