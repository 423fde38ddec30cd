"""The control channel: one task owns one ZeroMQ socket and does all its sends and receives.

ZeroMQ's notification FD is edge-triggered, and a *send* can consume the edge announcing a
message that has already arrived; a reader that only waits on the FD then sleeps forever with
messages queued (seen under load with many rooms). So: a single I/O task per socket, which
drains with ``NOBLOCK`` until ``zmq.Again``, re-reads ``zmq.EVENTS`` after every send and
before every wait, and only then waits on the FD. Other tasks hand frames to it through
:meth:`ControlSocket.send`, which never blocks and wakes the I/O task.

This uses only ``anyio.wait_readable`` on the FD, so it runs on asyncio, uvloop and trio.
"""

from __future__ import annotations

import errno
import logging
from collections import deque
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import zmq

from aioembed.errors import AioembedError

__all__ = ["ControlSocket", "FrameHandler", "SendErrorHandler"]

log = logging.getLogger(__name__)

FrameHandler = Callable[[list[bytes]], None]
SendErrorHandler = Callable[[Sequence[bytes], zmq.ZMQError], None]

_RECV_BATCH = 256


class ControlSocket:
    """Wraps a non-blocking ZeroMQ socket; :meth:`run` is its single I/O task.

    ``on_frames`` is called (synchronously, on the I/O task) for every received multipart
    message; it must not block. Exceptions it raises are logged and the loop goes on: one
    bad frame must not take the channel down.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        on_frames: FrameHandler,
        *,
        name: str,
        on_send_error: SendErrorHandler | None = None,
        max_outbox: int = 1 << 16,
    ) -> None:
        self.sock = sock
        self.name = name
        self._on_frames = on_frames
        self._on_send_error = on_send_error
        self._outbox: deque[Sequence[bytes]] = deque()
        self._max_outbox = max_outbox
        self._wake_scope: anyio.CancelScope | None = None
        self._poked = False
        self._closed = False
        self._drained = anyio.Event()
        self._drained.set()
        self.sent = 0
        self.received = 0

    def send(self, frames: Sequence[bytes]) -> None:
        """Queue one multipart message for the I/O task. Never blocks."""
        if self._closed:
            raise AioembedError(f"control socket {self.name} is closed")
        if len(self._outbox) >= self._max_outbox:
            raise AioembedError(
                f"control socket {self.name}: {len(self._outbox)} messages queued and not sent "
                f"(peer not reading?); refusing more"
            )
        self._outbox.append(frames)
        if self._drained.is_set():
            self._drained = anyio.Event()
        self._poke()

    def _poke(self) -> None:
        self._poked = True
        if self._wake_scope is not None:
            self._wake_scope.cancel()

    @property
    def queued(self) -> int:
        """Messages waiting to be handed to ZeroMQ."""
        return len(self._outbox)

    def _flush(self) -> None:
        sock, outbox = self.sock, self._outbox
        while outbox:
            frames = outbox[0]
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return  # high-water mark: wait for the FD to signal POLLOUT
            except zmq.ZMQError as exc:
                outbox.popleft()
                if exc.errno == errno.EHOSTUNREACH:
                    log.debug("%s: peer unreachable, message dropped", self.name)
                else:
                    log.warning("%s: send failed: %s", self.name, exc)
                if self._on_send_error is not None:
                    self._on_send_error(frames, exc)
                continue
            outbox.popleft()
            self.sent += 1
        self._drained.set()

    def _drain(self) -> bool:
        """Receive up to one batch; True if the batch was full (more may be waiting)."""
        sock = self.sock
        for _ in range(_RECV_BATCH):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return False
            self.received += 1
            try:
                self._on_frames(frames)
            except Exception:
                log.exception("%s: handler failed on a %d-frame message; message dropped", self.name, len(frames))
        return True

    async def run(self) -> None:
        """The I/O loop; run it in the owner's task group and cancel it to stop."""
        sock = self.sock
        fd = int(sock.get(zmq.FD))
        try:
            while True:
                self._poked = False
                self._flush()
                more = self._drain()
                events = int(sock.get(zmq.EVENTS))
                if more or events & zmq.POLLIN or self._poked or (self._outbox and events & zmq.POLLOUT):
                    await anyio.lowlevel.checkpoint()
                    continue
                with anyio.CancelScope() as scope:
                    self._wake_scope = scope
                    await anyio.wait_readable(fd)
                self._wake_scope = None
        finally:
            self._wake_scope = None

    async def drain(self) -> None:
        """Wait until every queued message was handed to ZeroMQ (bound it with a timeout)."""
        await self._drained.wait()

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket; ZeroMQ keeps trying to deliver handed-over frames for ``linger_ms``."""
        if not self._closed:
            self._closed = True
            if self._outbox:
                log.warning("%s: closing with %d unsent messages", self.name, len(self._outbox))
            self._outbox.clear()
            self.sock.close(linger=linger_ms)
