"""The control floor: the raw transfer framed by the least any ZeroMQ-coordinated transfer must say.

A receiver-driven transfer needs two control messages on its critical path whatever the library:
the receiver's request reaching the sender (where to write), and the sender's "done" reaching the
receiver (the rows may be read). The floor times exactly that around the raw baseline's transfer,
with plain pyzmq and nothing else:

1. an untimed ``prime`` from here asks the *floor peer* (a bare child process, blocked in ``recv``) to
   begin; it reads the clock (``t0``) and sends ``ask``;
2. here, woken by ``ask``, the raw transfer runs, then ``done`` goes out;
3. the peer, woken by ``done``, reads the clock (``t1``) and answers both readings (untimed).

``t1 - t0`` on the shared ``time.monotonic`` clock is the floor: one hop each way (the wake-ups of
idle threads included, which on small VMs are most of a hop) plus raw. No receiver-driven library
over ZeroMQ can beat it, so ``raw / floor`` is the highest ratio to raw it could reach on this
machine, at this size. The peer side blocks (the cheapest wake-up there is); this side waits on the
socket's FD in the event loop, as any asyncio/trio program would.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Awaitable, Callable

import anyio
import zmq

from aioembed.bench.baselines import BaselinePeer
from aioembed.errors import TransportError

__all__ = ["ControlFloor"]

_PRIME, _ASK, _DONE = b"prime", b"ask", b"done"
_TIMES = struct.Struct("<dd")


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
        await self._peer.start("aioembed.bench.control_floor", {"address": f"tcp://127.0.0.1:{port}"},
                               self.START_TIMEOUT)
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
        try:
            await self._send(sock, _PRIME)
            got = await self._recv(sock)
            if got != _ASK:
                raise TransportError(f"control floor: expected {_ASK!r} from the floor peer, got {got[:32]!r}")
            await transfer()
            await self._send(sock, _DONE)
            reply = await self._recv(sock)
        except TimeoutError:
            raise TransportError(f"control floor: the floor peer did not answer within {self._timeout} s; its "
                                 f"stderr ends with: {self._peer.stderr_tail()!r}") from None
        if len(reply) != _TIMES.size:
            raise TransportError(f"control floor: expected two clock readings ({_TIMES.size} bytes) from the floor "
                                 f"peer, got {reply[:32]!r}")
        t0, t1 = _TIMES.unpack(reply)
        return float(t0), float(t1)

    async def _send(self, sock: zmq.Socket[bytes], msg: bytes) -> None:
        """Hand ``msg`` to ZeroMQ; only before the peer's connection is up does it wait (for ``POLLOUT``)."""
        with anyio.fail_after(self._timeout):
            while True:
                try:
                    sock.send(msg, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    await self._wait(sock, zmq.POLLOUT)

    async def _recv(self, sock: zmq.Socket[bytes]) -> bytes:
        with anyio.fail_after(self._timeout):
            while True:
                try:
                    return sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    await self._wait(sock, zmq.POLLIN)

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


def _serve(address: str) -> None:
    """The floor peer: connect, say ready on stdout, then answer ``prime`` and ``done`` until stdin closes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    print(json.dumps({"ready": True}), flush=True)
    t0 = 0.0
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if sock in ready:
            msg = sock.recv()
            if msg == _PRIME:
                t0 = time.monotonic()
                sock.send(_ASK)
            elif msg == _DONE:
                t1 = time.monotonic()
                sock.send(_TIMES.pack(t0, t1))
        if sys.stdin.fileno() in ready or sys.stdin in ready:
            line = sys.stdin.readline()
            if not line or json.loads(line).get("op") == "exit":
                print(json.dumps({"exit": True}), flush=True)
                break
    sock.close(0)
    ctx.term()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1])["address"])
