"""The control channel: one task owns one ZeroMQ socket and does all its sends and receives.

ZeroMQ's notification FD is edge-triggered, and a *send* can consume the edge announcing a
message that has already arrived; a reader that only waits on the FD then sleeps forever with
messages queued (seen under load with many rooms). So: a single I/O task per socket, which
drains with ``NOBLOCK`` until ``zmq.Again``, re-reads ``zmq.EVENTS`` after every send and
before every wait, and only then waits on the FD. Other tasks send through
:meth:`ControlSocket.send`, which never blocks: with nothing queued for the peer it hands the frame
to ZeroMQ at once (all tasks share one thread) and re-reads ``zmq.EVENTS``, waking the I/O task
only if input is waiting; otherwise it queues the frame and wakes the I/O task.

With ``bundles=True`` (the protocol's channels), several messages to one peer go as one ZeroMQ
message (a *bundle*: one frame per message, behind the peer's identity for a ROUTER) when they queue
up: a send from a task while an earlier one to that peer went straight to ZeroMQ since the I/O task
last ran (a burst: many rooms finishing in one loop turn) is queued, and the I/O task hands the
queue over in bundles. Each ZeroMQ message wakes ZeroMQ's I/O thread and the peer's; a bundle does
so once. A lone message still goes at once, so a single room waits for nothing. The receiving side
splits bundles, so the handler sees one message at a time either way. Without it (a monitor socket,
whose events are two frames) messages go and come as they are.

For a ROUTER (``routed=True``, the first frame names the peer), frames queue per peer: a peer
at its high-water mark (``zmq.Again``) is skipped, with a short growing retry delay, while frames
to every other peer go on. A ROUTER's ``POLLOUT`` is always set, so waiting on it would spin; the
I/O task instead waits on the FD or until the earliest retry.

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
from aioembed.log_budget import WarningBudget

__all__ = ["ControlSocket", "FrameHandler"]

log = logging.getLogger(__name__)

FrameHandler = Callable[[list[bytes]], None]

_RECV_BATCH = 256
_RECV_BATCH_BYTES = 4 << 20
"""A batch also ends once it received this many bytes: handling a frame costs time by its size (decoding and
checking 40 valid 5.7 MB STATUS frames in one batch held the loop for 13 s)."""
_BUNDLE_MAX = 64
_BUNDLE_BYTES = 1 << 20
"""A bundle holds at most this many messages and (unless a single message is larger) bytes."""
_RETRY_FIRST = 0.001
_RETRY_MAX = 0.05


class ControlSocket:
    """Wraps a non-blocking ZeroMQ socket; :meth:`run` is its single I/O task.

    ``on_frames`` is called (synchronously, on the I/O task) for every received message; it must not
    block. Exceptions it raises are logged and the loop goes on: one bad frame must not take the
    channel down. With ``bundles``, a message is one payload frame, behind the peer's identity for a
    ROUTER (``[identity, payload]`` when ``routed``, else ``[payload]``), both to :meth:`send` and to
    ``on_frames`` (once per frame of a received bundle); the peer must bundle too.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        on_frames: FrameHandler,
        *,
        name: str,
        max_outbox: int = 1 << 16,
        routed: bool = False,
        bundles: bool = False,
    ) -> None:
        self.sock = sock
        self.name = name
        self._on_frames = on_frames
        self._routed = routed
        self._bundles = bundles
        # peer (first frame for a ROUTER, b"" otherwise) -> its queued messages, in arrival order
        self._outboxes: dict[bytes, deque[Sequence[bytes]]] = {}
        self._blocked: dict[bytes, tuple[float, float]] = {}  # peer -> (retry at, current delay)
        self._queued = 0
        self._fresh: set[bytes] = set()  # peers sent to at once since the I/O task last ran
        self._running = False  # the I/O task runs (only then can a queued message wait for it)
        self._max_outbox = max_outbox
        self._wake_scope: anyio.CancelScope | None = None
        self._fd: int | None = None  # the FD the I/O task waits on, while it runs
        self._poked = False
        self._closed = False
        self._drained = anyio.Event()
        self._drained.set()
        self._warnings = WarningBudget(log)  # what a peer sends wrong, as fast as it likes: a line per window
        self.sent = 0
        self.received = 0
        self.bundles_sent = 0
        """ZeroMQ messages that carried more than one message."""

    def send(self, frames: Sequence[bytes]) -> None:
        """Send one multipart message (the peer's identity first when routed) or queue it for the I/O
        task. Never blocks."""
        if self._closed:
            raise AioembedError(f"control socket {self.name} is closed")
        if self._bundles and len(frames) != (2 if self._routed else 1):
            shape = "[identity, payload]" if self._routed else "[payload]"
            raise AioembedError(f"control socket {self.name}: a message is {shape}, got {len(frames)} frames")
        peer = bytes(frames[0]) if self._routed else b""
        if peer not in self._outboxes and peer not in self._fresh and self._send_now(frames):
            if self._bundles and self._running:
                self._fresh.add(peer)
            return
        outbox = self._outboxes.setdefault(peer, deque())
        if len(outbox) >= self._max_outbox:  # per peer: one peer not reading does not stop the others
            raise AioembedError(
                f"control socket {self.name}: {len(outbox)} messages queued and not sent to "
                f"{'peer ' + peer.hex()[:16] if self._routed else 'the peer'} (not reading?); refusing more"
            )
        outbox.append(frames)
        self._queued += 1
        if self._drained.is_set():
            self._drained = anyio.Event()
        self._poke()

    def _send_now(self, frames: Sequence[bytes]) -> bool:
        """Hand ``frames`` to ZeroMQ at once when nothing is queued for their peer and nothing went to it
        at once since the I/O task last ran (the usual case): no wake-up of the I/O task. A send may
        consume the edge of a message that already arrived, so ``zmq.EVENTS`` is read again afterwards
        and the I/O task woken if input is waiting: after a send ZeroMQ refused too (``EHOSTUNREACH`` to a
        receiver that left), which ran libzmq's pending commands all the same. Missed there, a receiver's
        HELLO arriving meanwhile waited until some later send went through, and a sender whose only receiver
        had just reconnected never answered it."""
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return False  # at the high-water mark: the caller queues it and wakes the I/O task, which retries
        except zmq.ZMQError as exc:
            self._send_failed(exc)
            self._wake_if_input()
            return True
        self.sent += 1
        self._wake_if_input()
        return True

    def _wake_if_input(self) -> None:
        if int(self.sock.get(zmq.EVENTS)) & zmq.POLLIN:
            self._poke()

    def _send_failed(self, exc: zmq.ZMQError) -> None:
        """A message ZeroMQ refused for good (not ``Again``): dropped and logged."""
        if exc.errno == errno.EHOSTUNREACH:
            log.debug("%s: peer unreachable, message dropped", self.name)
        else:
            self._warnings.warn("send", "%s: send failed: %s", self.name, exc)

    def reconnect(self, endpoint: str) -> None:
        """Drop this socket's connection to ``endpoint`` and connect to it again (a connecting socket with that one
        peer): every message not yet sent (held by ZeroMQ for the old connection, or queued here) goes with it,
        and what is sent from now on goes to the new one. A connection that stays open while nothing comes
        through it (its peer's host gone without a FIN) is given up by the kernel only after minutes of
        retransmits, and ZeroMQ reconnects (and resolves the name again) only then. Raises ``zmq.ZMQError`` if
        ``endpoint`` is not one this socket connected to (nothing changed then)."""
        if self._closed:
            return
        self.sock.disconnect(endpoint)
        self.sock.connect(endpoint)
        if self._queued:
            log.debug("%s: %d unsent messages dropped with the old connection", self.name, self._queued)
        self._outboxes.clear()
        self._blocked.clear()
        self._fresh.clear()
        self._queued = 0
        self._drained.set()
        # Both ran libzmq's pending commands, which may consume the FD's edge of input that already arrived.
        self._wake_if_input()

    def _poke(self) -> None:
        self._poked = True
        if self._wake_scope is not None:
            self._wake_scope.cancel()

    @property
    def queued(self) -> int:
        """Messages waiting to be handed to ZeroMQ."""
        return self._queued

    @property
    def blocked_peers(self) -> int:
        """Peers whose frames wait because they are at their high-water mark."""
        return len(self._blocked)

    def _flush(self, now: float) -> float | None:
        """Hand queued frames to ZeroMQ, peer by peer; returns the earliest retry of a blocked peer."""
        sock = self.sock
        for peer in list(self._outboxes):
            blocked = self._blocked.get(peer)
            if blocked is not None and blocked[0] > now:
                continue
            outbox = self._outboxes[peer]
            while outbox:
                n, frames = self._bundle(outbox)
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    # This peer is at its high-water mark: try again later, the others go on.
                    delay = min(_RETRY_MAX, blocked[1] * 2) if blocked is not None else _RETRY_FIRST
                    self._blocked[peer] = (now + delay, delay)
                    break
                except zmq.ZMQError as exc:
                    for _ in range(n):
                        outbox.popleft()
                        self._send_failed(exc)
                    self._queued -= n
                    continue
                for _ in range(n):
                    outbox.popleft()
                self._queued -= n
                self.sent += n
                if n > 1:
                    self.bundles_sent += 1
            else:
                del self._outboxes[peer]
                self._blocked.pop(peer, None)
        if not self._outboxes:
            self._drained.set()
        return min((at for at, _ in self._blocked.values()), default=None)

    def _bundle(self, outbox: deque[Sequence[bytes]]) -> tuple[int, Sequence[bytes]]:
        """The first messages of ``outbox`` as one ZeroMQ message: how many, and its frames."""
        first = outbox[0]
        if not self._bundles:
            return 1, first
        size = len(first[-1])
        n = 1
        while n < len(outbox) and n < _BUNDLE_MAX:
            size += len(outbox[n][-1])
            if size > _BUNDLE_BYTES:
                break
            n += 1
        payloads = [outbox[i][-1] for i in range(n)]
        return n, [first[0], *payloads] if self._routed else payloads

    def receive_pending(self) -> int:
        """Hand every message already queued on the socket to the handler, now (from any task of the
        loop: the I/O task re-checks ``zmq.EVENTS`` before it waits). Returns how many there were."""
        if self._closed:
            return 0
        before = self.received
        while self._drain():
            pass
        return self.received - before

    def _drain(self) -> bool:
        """Receive up to one batch (``_RECV_BATCH`` messages, a bundle counting each of its messages, or
        ``_RECV_BATCH_BYTES``, whichever comes first); True if the batch was full (more may be waiting). The I/O
        task yields between batches, so a peer flooding this socket does not hold the event loop."""
        sock = self.sock
        budget = _RECV_BATCH
        nbytes = 0
        while budget > 0 and nbytes < _RECV_BATCH_BYTES:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return False
            budget -= 1
            size = sum(len(f) for f in frames)
            nbytes += size
            if not self._bundles:
                messages = [frames]
            else:
                payloads = frames[1:] if self._routed else frames
                if not payloads or len(payloads) > _BUNDLE_MAX:
                    # A peer bundles at most _BUNDLE_MAX messages: a larger one (say a million tiny frames in
                    # one 16 MiB message) would be handled in one go, the loop held all the while.
                    self._warnings.warn("bundle", "%s: dropped a ZeroMQ message of %d payload frames (a bundle "
                                        "holds 1..%d)", self.name, len(payloads), _BUNDLE_MAX)
                    continue
                if self._routed:
                    size -= len(frames[0])  # the peer's identity is not part of what it bundled
                if len(payloads) > 1 and size > _BUNDLE_BYTES:
                    # A peer bundles messages only up to _BUNDLE_BYTES together (a larger one goes alone), while
                    # ZeroMQ's MAXMSGSIZE bounds each frame: 64 frames near it would be decoded in one loop turn.
                    self._warnings.warn("bundle", "%s: dropped a bundle of %d messages and %d bytes (a bundle of "
                                        "several holds at most %d bytes)", self.name, len(payloads), size,
                                        _BUNDLE_BYTES)
                    continue
                messages = [[frames[0], payload] for payload in payloads] if self._routed else [[p] for p in payloads]
                budget -= len(messages) - 1
            for message in messages:
                if self._closed:  # the handler closed this channel: the rest of its bundle goes with the socket
                    return False
                self.received += 1
                try:
                    self._on_frames(message)
                except Exception:
                    log.exception("%s: handler failed on a message; message dropped", self.name)
            if self._closed:  # the handler closed this channel: what is left on the socket went with it
                return False
        return True

    async def run(self) -> None:
        """The I/O loop; run it in the owner's task group and cancel it to stop. It returns once the socket is
        closed (:meth:`close` wakes it)."""
        sock = self.sock
        if self._closed:
            return
        fd = int(sock.get(zmq.FD))
        self._fd = fd
        self._running = True
        try:
            while not self._closed:
                self._poked = False
                self._fresh.clear()
                retry_at = self._flush(anyio.current_time())
                received = self.received
                more = self._drain()
                if self._closed:
                    break
                events = int(sock.get(zmq.EVENTS))
                ready = bool(self._outboxes) and retry_at is None and bool(events & zmq.POLLOUT)
                # After handing messages over, the tasks they woke run first: re-arming the wait below
                # (a cancel scope, the reader added and removed) took tens of microseconds that every
                # woken room waited through before its task ran (a small request's latency).
                if more or events & zmq.POLLIN or self._poked or ready or self.received != received:
                    await anyio.lowlevel.checkpoint()
                    continue
                # Nothing to do now: wait for the FD, a new message to send, or a blocked peer's retry.
                wait = None if retry_at is None else max(0.0, retry_at - anyio.current_time())
                with anyio.CancelScope() as scope:
                    self._wake_scope = scope
                    with anyio.move_on_after(wait):
                        try:
                            await anyio.wait_readable(fd)
                        except anyio.ClosedResourceError:
                            if not self._closed:
                                raise
                self._wake_scope = None
        finally:
            self._fd = None
            self._wake_scope = None
            self._running = False  # sends from now on go at once, as before the task started
            self._fresh.clear()

    async def drain(self) -> None:
        """Wait until every queued message was handed to ZeroMQ (bound it with a timeout)."""
        await self._drained.wait()

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket; ZeroMQ keeps trying to deliver handed-over frames for ``linger_ms``. A
        :meth:`drain` waiting now, or called later, returns: nothing more will be sent. A running :meth:`run`
        returns."""
        if not self._closed:
            self._closed = True
            if self._queued:
                log.warning("%s: closing with %d unsent messages", self.name, self._queued)
            self._outboxes.clear()
            self._queued = 0
            self._drained.set()
            if self._fd is not None:
                # The I/O task waits on this FD: the wait ends now, before the FD goes (closing it under the wait
                # raised ENOTSOCK in the task on uvloop, and left it waiting on a dead FD on asyncio and trio).
                anyio.notify_closing(self._fd)
            self.sock.close(linger=linger_ms)
