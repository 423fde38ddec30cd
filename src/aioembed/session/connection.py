"""A receiver's control connection to one sender: handshake sessions, heartbeats, routing.

Each handshake opens a *session* with a new epoch. Everything announced in a session is owned by
the writer ``(sender process id, epoch)``. ZeroMQ keeps the frames of one connection in order and
a sender never sends a frame for a session after replacing or dropping it, so every frame that
arrives before ``WELCOME(epoch + 1)`` belongs to the previous session: late answers are
attributed to the right writer without carrying an epoch on every frame.

When the session is lost, the connection reports it to the ledger (which fences what the writer
may still reach), to the rooms (which end, or open again if the sender never started them), and
shakes hands again:

* ``SILENT``: no frame for ``heartbeat_interval x heartbeat_misses`` (our own stalls forgiven);
* ``DROPPED``: the sender answered ``unknown_peer`` (it restarted, or declared *us* dead);
* ``DISCONNECTED``: the control connection dropped. That the sender's process is gone (what it wrote can land
  for the transport's ``orphan_lifetime`` at most) is taken only from its host: its address refusing a connection
  (:mod:`aioembed.control.address_probe`), or a new sender id answering there. A drop in a live session with an
  address that does not answer counts too: the sender's side closed it while we still heard it (a process killed
  with its network namespace). A drop after the sender went silent is what the *receiver's* kernel does to a host
  that is paused or cut off, whose writes may still land: its blocks stay fenced until proof, probed again and again.
  A connection found ``SILENT`` is dropped by the receiver itself and made again (its far end may be a host gone
  without a FIN, which the kernel gives up on only after minutes): that counts as such a drop after silence.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import random
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import zmq
from zmq.utils.monitor import parse_monitor_message

from aioembed.config import TransferConfig
from aioembed.control.address_probe import ProbeVerdict, probe_address
from aioembed.control.channel import ControlSocket
from aioembed.control.sockets import make_dealer
from aioembed.errors import (
    AioembedError,
    IncompatiblePeer,
    ProtocolError,
    TransferError,
    TransferFailed,
    TransferTimeout,
    TransportError,
    room_prefix,
)
from aioembed.layout import Layout
from aioembed.log_budget import WarningBudget
from aioembed.memory.pool import BlockPool
from aioembed.protocol.messages import (
    Abort,
    AbortAck,
    Drained,
    FenceRelease,
    Hello,
    Message,
    Ping,
    Pong,
    Progress,
    Reject,
    RoomId,
    Status,
    Total,
    TransferStatus,
    Welcome,
    decode,
    encode,
)
from aioembed.protocol.ownership import Proof, Writer
from aioembed.session.block_keeper import BlockKeeper
from aioembed.session.lease import LeaseReturns
from aioembed.session.liveness import LoopWatch, PeerClock
from aioembed.session.room_id_holds import RoomIdHolds
from aioembed.transports.boundary import GuardedTransport

if TYPE_CHECKING:
    from aioembed.session.receive_room import ReceiveRoomDriver

__all__ = ["LossKind", "SenderConnection", "SessionLost"]

log = logging.getLogger("aioembed.session.connection")

REFUSAL_RETRY = 5.0
"""Seconds between handshakes with a sender that refused ours (incompatible settings or protocol)."""
_MIN_PING_INTERVAL = 0.01
"""However short the sender's heartbeat interval, at most 100 PINGs a second."""
PROBE_TIMEOUT = 5.0
"""Seconds a probe of a dropped sender's address waits for an answer."""
PROBE_RETRY_FIRST = 1.0
PROBE_RETRY_MAX = 60.0
"""Seconds between probes of an address that did not answer (doubling from the first to the most)."""
HELLO_BACKOFF_FIRST = 0.05
HELLO_BACKOFF_MAX = 1.0
"""Seconds before HELLO again after a refusal worth retrying (busy, or a transport connect that failed):
doubling from the first to the most, each pause drawn from the upper half of its step (see :func:`hello_backoff`)."""


def hello_backoff(retry: int, draw: float) -> float:
    """The pause before the ``retry``-th HELLO again (0: the first) after refusals worth retrying; ``draw`` is a
    uniform draw from [0, 1). Receivers refused together (a cluster restarting into a sender at its
    ``max_concurrent_handshakes``) said HELLO again in lockstep, and were refused together again, at every step of
    the same doubling: each pause now lies anywhere in the upper half of its step, which spreads them out while
    keeping the step's bounds (never sooner than half of it, never later than it)."""
    if retry < 0 or not 0.0 <= draw < 1.0:
        raise ValueError(f"retry={retry} must be >= 0 and draw={draw} in [0, 1)")
    step = min(HELLO_BACKOFF_FIRST * 2.0 ** min(retry, 64), HELLO_BACKOFF_MAX)
    return step * (0.5 + 0.5 * draw)


FENCE_SETTLE = 0.2
"""Seconds of our running time between a FENCE_RELEASE or DRAINED and the free: bytes the
sender's transport already handed to our kernel (e.g. while we were frozen) land meanwhile."""


@dataclass(slots=True)
class _Drops:
    """What a connection knows of the drops of its control connection, for the probe of the sender's address."""

    probing: str | None = None
    """The sender whose address a probe task asks."""
    live: bool = False
    """The last drop ended a live session."""
    again: anyio.Event = field(default_factory=anyio.Event)
    """Set at a drop: cuts a probe's wait short."""


class LossKind(enum.Enum):
    """How a session with a sender ended."""

    SILENT = "silent"
    DROPPED = "dropped"
    DISCONNECTED = "disconnected"
    CLOSING = "closing"


@dataclass(frozen=True, slots=True)
class SessionLost:
    """Delivered to the rooms of a lost session."""

    kind: LossKind
    reason: str
    writer: Writer


RoomFrame = Status | Progress | Total | Abort | AbortAck | Reject | FenceRelease
"""A frame of the sender about one room."""
RoomEvent = RoomFrame | SessionLost


class SenderConnection:
    """One sender, as seen by one receiver: a DEALER socket and the sessions over it."""

    waiters: int = 0
    """``wait_connected()`` calls awaiting this connection's handshake: it is in use though no room is on it (the
    receiver closes it neither to make room under ``max_senders`` nor as idle)."""

    def __init__(self, address: str, *, ctx: zmq.Context[zmq.Socket[bytes]], config: TransferConfig,
                 layout: Layout, pool: BlockPool, rank: int, world: int, receiver_id: str, keeper: BlockKeeper,
                 transport: GuardedTransport, returns: LeaseReturns, spawn: Callable[..., object],
                 next_epoch: Callable[[], int],
                 twin_of: Callable[[SenderConnection, str], SenderConnection | None]) -> None:
        self.address = address
        self.config = config
        self.layout = layout
        self.pool = pool
        self.rank = rank
        self.world = world
        self.receiver_id = receiver_id
        self.keeper = keeper
        self.transport = transport
        self.returns = returns
        self._spawn = spawn
        self.name = f"receiver[{rank}]<-{address}"
        self.rooms: dict[RoomId, ReceiveRoomDriver] = {}
        self._warnings = WarningBudget(log)  # bad frames from the sender: a flood of them logs one line per window
        self._peer_interval = math.inf
        """The sender's heartbeat_interval (from its WELCOME)."""
        self.held_ids = RoomIdHolds()
        """Ids of rooms that ended here about which the sender may still say something (its answer to our
        ABORT, to a RESUME that crossed the end): a new attempt of the id waits (see room_id_holds)."""
        self._ids_released = anyio.Event()
        self.epoch = 0
        self._next_epoch = next_epoch
        """The receiver's epochs, which grow across its connections: a connection to a sender that closed
        (idle, evicted) and a new one to it must not both say session 1, or the sender, still holding the
        old connection's later session, ignores the new one's HELLO (and the writers of both collide)."""
        self.sender_id: str | None = None
        self.writer: Writer | None = None
        """The writer of the last WELCOMEd session: frames that arrive are from it."""
        self.writer_id = ""
        self.refused: TransferError | None = None
        """Why no handshake holds now (the sender refused ours, or our side cannot say HELLO); tried again."""
        self.last_refusal: str | None = None
        self.sessions = 0
        self._ready = anyio.Event()
        self._answered = anyio.Event()
        self._nudge = anyio.Event()
        self._lost = anyio.Event()
        self._closed = False
        self.stop_scope = anyio.CancelScope()
        """Cancelled to close this connection (its tasks run under it)."""
        self.last_used = 0.0
        """When a room last started on this connection (``anyio.current_time()``)."""
        self._gone_sender: str | None = None
        self._drops = _Drops()
        self._twin_of = twin_of
        """Another connection of this receiver with a live session with the sender of this id, if any (the same
        sender under two addresses: see :meth:`_refuse_twin`)."""
        self._twin_sender: str | None = None  # the sender id this connection found held by a twin
        self.clock = PeerClock(0.0)
        self._pings: deque[int] = deque(maxlen=8)
        self._nonce_base = uuid.uuid4().int & ((1 << 62) - 1)
        self.chan, self.monitor = self._open_sockets(ctx)
        self._handlers: dict[type, Callable[[Any], None]] = {
            Welcome: self._on_welcome, Reject: self._on_reject, Status: self._on_room_frame,
            Progress: self._on_room_frame, Total: self._on_room_frame,
            Abort: self._on_room_frame, AbortAck: self._on_room_frame, FenceRelease: self._on_fence_release,
            Drained: self._on_drained, Pong: self._on_pong, Ping: self._on_ping,
        }

    def _open_sockets(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[ControlSocket, ControlSocket]:
        """The DEALER to the sender, and the monitor that tells when its TCP connection drops."""
        sock = make_dealer(ctx, self.address, self.config)
        try:
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return (ControlSocket(sock, self._on_frames, name=self.name, bundles=True),
                ControlSocket(mon, self._on_monitor, name=f"{self.name}:monitor"))

    # -- public-ish ----------------------------------------------------------------------------

    def touch(self) -> None:
        """A room is starting on this connection: it is not idle."""
        self.last_used = anyio.current_time()

    @property
    def ready(self) -> bool:
        """True while a session is established and usable for new rooms."""
        return self._ready.is_set() and self.refused is None and not self._closed

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: nothing is sent or received any more."""
        return self._closed

    async def wait_ready(self, timeout: float, *, room: RoomId | None = None) -> Writer:
        """The current session's writer, once a handshake holds; ``TransferTimeout`` otherwise. ``room``: the
        room that waits, named by the error."""
        with anyio.move_on_after(timeout):
            await self._ready.wait()
        where = room_prefix(room)
        if self.refused is not None:
            raise self._refusal(self.refused, room)
        if self._closed:
            raise TransferFailed(f"{where}the connection to sender {self.address} was closed (receiver rank "
                                 f"{self.rank})", room=room)
        if not self._ready.is_set() or self.writer is None:
            why = f"; its last refusal: {self.last_refusal}" if self.last_refusal else ""
            raise TransferTimeout(f"{where}no handshake with sender {self.address} within {timeout} s "
                                  f"(receiver rank {self.rank}){why}", room=room, phase="handshake")
        return self.writer

    @staticmethod
    def _refusal(refused: TransferError, room: RoomId | None) -> TransferError:
        """The connection's refusal, as an error of its own for one waiter. The refusal is one object for every
        room waiting for the handshake: raised itself, each room's error was that object (naming no room; a
        stream's ``delivered`` set on it showed in the others), and each raise added its room's frames, which
        hold the caller's ``out=`` buffers, to its one traceback for as long as any of them was kept."""
        where = room_prefix(room)
        try:
            error = type(refused)(f"{where}{refused}", room=room)
        except TypeError:  # an error class with other arguments: keep the message
            error = TransferFailed(f"{where}{refused}", room=room)
        error.__cause__ = refused.__cause__  # what the refusal came from (the transport's error), if anything
        error.__suppress_context__ = True
        return error

    def send(self, msg: Message) -> bool:
        """Queue a frame for the sender (never blocks, never raises); False, the frame dropped, once the connection
        is closed (a room ending on a connection closed under it still ends: see :meth:`close`), or if the sender
        reads nothing (the control socket refuses more frames for it). That ends the session: a frame of it is
        lost (an ABORT, the PING that holds a room id), so nothing the sender says of it later can be matched with
        what we said. Its rooms fence what it may reach, as for a sender gone silent, and a new session's DRAINED
        frees that."""
        if self._closed:
            log.debug("%s: closed, %s not sent", self.name, type(msg).__name__)
            return False
        try:
            self.chan.send([encode(msg)])
            return True
        except ProtocolError as exc:  # a value of ours the wire cannot carry: lost like a refused frame
            why = f"{type(msg).__name__} for sender {self.address} cannot be encoded: {exc}"
        except AioembedError as exc:  # the control socket refuses more for a peer that does not read
            why = f"sender {self.address} reads nothing ({type(msg).__name__} not sent: {exc})"
        if self.ready:
            self.session_lost(LossKind.SILENT, why)  # which logs it
        else:  # between sessions (a HELLO): the handshake says it again later
            self._warnings.warn("not_sent", "%s: %s", self.name, why)
        return False

    def close(self) -> None:
        """Close the sockets (the owner cancels ``run`` first). Idempotent. Rooms still on the connection
        lose their session (each fences what the sender may still reach, and fails), and rooms waiting for a
        handshake fail: nothing will reach them any more."""
        if self._closed:
            return
        if self.rooms:
            self.session_lost(LossKind.CLOSING, f"the connection to sender {self.address} was closed")
        self._closed = True
        self._ready.set()  # handshake waiters wake and see the connection closed
        with contextlib.suppress(zmq.ZMQError):
            self.chan.sock.disable_monitor()
        self.monitor.close()
        self.chan.close()

    # -- the connection task -------------------------------------------------------------------

    async def run(self) -> None:
        """Handshake, then heartbeats until the session is lost; again, until closed. A refusal fails the rooms
        started meanwhile at once and is tried again every :data:`REFUSAL_RETRY` seconds (an operator fixes
        the sender's settings and restarts it at the same address: it used to stay refused for good)."""
        while not self._closed:
            await self._handshake()
            if self.refused is not None:
                log.error("%s: %s; trying again in %.0f s", self.name, self.refused, REFUSAL_RETRY)
                self._ready.set()  # wakes waiters, who then see the refusal
                await anyio.sleep(REFUSAL_RETRY)
                self._ready = anyio.Event()  # before the refusal goes: never "ready" without a session
                self.refused = None
                continue
            await self._heartbeats()

    async def _handshake(self) -> None:
        cfg = self.config
        if self._twin_sender is not None and self._refuse_twin(self._twin_sender):
            return  # not even a HELLO: it would end the twin's session again
        self._twin_sender = None
        self.epoch = self._next_epoch()
        self._answered = anyio.Event()
        self._lost = anyio.Event()
        try:
            hello = Hello(
                receiver_id=self.receiver_id, epoch=self.epoch, fingerprint=self.layout.fingerprint,
                transport=self.transport.name, descriptor=self.transport.descriptor(), block_size=cfg.block_size,
                num_blocks=cfg.pool_blocks, rank=self.rank, world=self.world,
                regions=tuple((reg.address, reg.length) for reg in self.pool.regions()),
                status_inline_bytes=self.pool.status_inline_budget(cfg.status_inline_bytes),
            )
            encode(hello)  # a descriptor the wire cannot carry fails here, with its cause, not as a lost frame
        except (TransportError, ProtocolError) as exc:
            # Our side cannot say HELLO (the transport could not describe itself: a NIXL agent's metadata, a UCX
            # listener). The rooms waiting for this sender fail now with the cause, not after their handshake
            # timeout with "connection closed"; tried again like a refusal (the transport may recover).
            self.refused = TransferFailed(f"receiver rank {self.rank} cannot shake hands with sender {self.address}: "
                                          f"{type(exc).__name__}: {exc}")
            self.refused.__cause__ = exc
            return
        retries = 0
        while not self._answered.is_set():
            self._nudge = anyio.Event()
            log.debug("%s: HELLO (session %d)", self.name, self.epoch)
            self.send(hello)
            with anyio.move_on_after(cfg.handshake_timeout):
                await self._nudge.wait()  # WELCOME, a final refusal, or a refusal worth retrying
            if self._answered.is_set():
                break
            if self._nudge.is_set():
                # Refused for now (the sender could not connect its transport to us yet, or was busy): try again
                # soon, so that rooms waiting for this handshake see several attempts within their deadline.
                await anyio.sleep(hello_backoff(retries, random.random()))
                retries += 1
            else:
                log.info("%s: no answer to HELLO (session %d) yet; saying it again", self.name, self.epoch)

    async def _heartbeats(self) -> None:
        cfg = self.config
        self._pings.clear()  # a late PONG to an earlier session's PING says nothing about this one
        # The sender declares us dead after its own heartbeat_interval x heartbeat_misses without a PING:
        # ping at its interval when that is shorter than ours (or it drops a live session, again and again).
        interval = min(cfg.heartbeat_interval, max(self._peer_interval, _MIN_PING_INTERVAL))
        limit = cfg.heartbeat_interval * cfg.heartbeat_misses
        # Our own stall tolerance stays ours: ordinary lag at a sender's short interval is not a stall.
        watch = LoopWatch(interval, tolerance=cfg.heartbeat_interval)
        nonce = 0
        while not self._lost.is_set():
            nonce += 1
            ping = (self._nonce_base + nonce) & ((1 << 62) - 1)  # unguessable, so PONGs can be checked
            self._pings.append(ping)
            self.send(Ping(nonce=ping))
            expected = anyio.current_time() + interval
            with anyio.move_on_after(interval):
                await self._lost.wait()
            if self._lost.is_set():
                return
            now = anyio.current_time()
            stall = watch.woke(now, expected)
            if stall:
                # Our own loop did not run: do not blame the sender for silence we could not hear,
                # and restart the windows of timed releases (buffered bytes land at thaw).
                log.warning("%s: the event loop stalled %.2f s", self.name, stall)
                self.clock.forgive(now, interval)
                self.keeper.stalled(now)
            self.returns.drain()
            for room in self.held_ids.overdue(now, limit):
                log.warning("%s: room=%r: the sender has not answered our ABORT in %.1f s though it answers "
                            "heartbeats; the room id is refused until it does (or the session ends)", self.name,
                            room, limit)
            if self.clock.silent(now, limit):
                self.session_lost(LossKind.SILENT, f"sender {self.address} silent for more than {limit:.1f} s")

    # -- session changes -----------------------------------------------------------------------

    def session_lost(self, kind: LossKind, reason: str) -> None:
        """End the current session: tell its rooms (each fences what the writer may still reach, in the
        order of its own inbox), learn what can be learnt about the sender, shake hands again."""
        writer = self.writer
        if not self.ready or writer is None:
            # Between sessions already: ``_ready`` is also set while refused (to wake handshake waiters), with the
            # writer of a session lost before; replacing it here left those waiters on an event nothing sets.
            return
        self._ready = anyio.Event()
        self._lost.set()
        log.warning("%s: session %d lost (%s): %s; %d rooms affected", self.name, writer.epoch, kind.value,
                    reason, sum(1 for r in self.rooms.values() if r.writer == writer))
        if self.transport.capabilities.revocable and self.writer_id and kind is not LossKind.CLOSING:
            # Cut off the links this sender opened so far (our sessions up to this one).
            self._spawn(self._revoke, writer.sender, self.writer_id, writer.epoch + 1)
        event = SessionLost(kind, reason, writer)
        self.held_ids.session_ended()
        self._release_ids()
        for room in list(self.rooms.values()):
            room.session_lost(event)
        if kind is LossKind.SILENT:
            self._reconnect()

    def _reconnect(self) -> None:
        """The sender went silent: the next HELLO goes over a new TCP connection. Said into the old one, whose
        far end may be a host gone without a FIN (a node lost, a pod rescheduled behind the same name), it reached
        nobody until our kernel gave that connection up after about 15 minutes of retransmits, and only then did
        ZeroMQ connect again (resolving the name again): a sender started again there waited that long. Our own
        disconnect is reported by no monitor event, so it counts here as the drop after silence that the kernel
        would have reported later: the address is asked whether anything listens there (a refusal proves the
        process gone), as after that drop (see :meth:`_probe_gone`)."""
        if self._closed:
            return
        try:
            self.chan.reconnect(self.address)
        except zmq.ZMQError as exc:
            log.warning("%s: could not reconnect to the silent sender (%s); its connection is kept", self.name, exc)
            return
        log.info("%s: reconnecting to the silent sender", self.name)
        self._dropped(live=False)

    async def _revoke(self, sender: str, writer_id: str, below_epoch: int) -> None:
        try:
            await self.transport.revoke(writer_id)
        except Exception as exc:  # TransportError: the blocks stay fenced until another proof
            log.warning("%s: could not revoke %s: %s", self.name, writer_id[:16], exc)
            return
        log.info("%s: revoked writer %s of sender %s (sessions below %d)", self.name, writer_id[:16],
                 sender[:8], below_epoch)
        self.keeper.revoked(sender, below_epoch=below_epoch)

    def _on_welcome(self, msg: Welcome) -> None:
        if msg.epoch != self.epoch or self._answered.is_set():
            log.debug("%s: WELCOME for session %d ignored (current %d)", self.name, msg.epoch, self.epoch)
            return
        if self._refuse_twin(msg.sender_id):
            self._answered.set()
            self._nudge.set()
            return
        old = self.sender_id
        if old is not None and msg.sender_id != old:
            # Another process answers at the address: the old one released it, so it is gone.
            log.warning("%s: the sender restarted (id %s, was %s); its earlier writes are waited out for %.1f s",
                        self.name, msg.sender_id[:8], old[:8], self.transport.orphan_lifetime)
            self.keeper.writer_gone(old, lifetime=self.transport.orphan_lifetime)
        elif old is not None and self._gone_sender == old:
            log.info("%s: sender %s is back; it was not gone after all", self.name, old[:8])
            self.keeper.writer_back(old)
        self._gone_sender = None
        self._drops.live = False  # a drop of an earlier session says nothing of how this one ends
        self.sender_id = msg.sender_id
        self.writer_id = msg.writer_id
        self._peer_interval = msg.heartbeat_interval
        self.writer = Writer(msg.sender_id, self.epoch, self.address)
        self.sessions += 1
        self.clock.heard(anyio.current_time())
        self._answered.set()
        self._nudge.set()
        self._ready.set()
        log.info("%s: connected (session %d, sender %s)", self.name, self.epoch, msg.sender_id[:8])

    def _refuse_twin(self, sender_id: str) -> bool:
        """True, with the handshake refused, if another connection of this receiver holds the sender ``sender_id``:
        one sender reached under two addresses (``tcp://10.0.0.5:5555`` and ``tcp://enc0:5555``). The sender keeps
        one session per receiver, so each connection's HELLO ended the other's session and the two took turns for
        good, each turn failing the rooms in flight. This one stands down, and says so to its rooms, for as long
        as the twin holds that sender (its first HELLO ended the twin's session once)."""
        twin = self._twin_of(self, sender_id)
        if twin is None:
            return False
        self._twin_sender = sender_id
        self.refused = TransferFailed(
            f"sender {self.address} is the sender (id {sender_id[:8]}) this receiver (rank {self.rank}) already "
            f"reaches at {twin.address}: one sender under two addresses; name it by one (each handshake would end "
            f"the other's session)")
        return True

    # -- frames ------------------------------------------------------------------------------

    def _on_monitor(self, frames: list[bytes]) -> None:
        try:
            event = parse_monitor_message(frames)
        except Exception as exc:
            log.debug("%s: unreadable monitor event: %r", self.name, exc)
            return
        if event["event"] == zmq.EVENT_DISCONNECTED and not self._closed:
            # Frames that arrived before the disconnect (a last STATUS) are still queued on the
            # data socket, and this event can overtake them: take them first.
            self.chan.receive_pending()
            live = self._ready.is_set()
            if live:
                self.session_lost(LossKind.DISCONNECTED, f"sender {self.address} closed the control connection")
            self._dropped(live=live)

    def _dropped(self, *, live: bool) -> None:
        """The control connection dropped (``live``: it ended a live session): ask the sender's address."""
        drops = self._drops
        drops.live = live
        drops.again.set()
        sender = self.sender_id
        if sender is not None and sender not in (self._gone_sender, drops.probing):
            drops.probing = sender
            self._spawn(self._probe_gone, sender)

    def sender_gone(self, sender: str, why: str) -> None:
        """Sender ``sender``'s process is known gone (``why``): what it wrote can land for ``orphan_lifetime``
        at most, and then its fenced blocks are free. (Back after all: its WELCOME says so.)"""
        if self._gone_sender == sender:
            return
        self._gone_sender = sender
        log.info("%s: sender %s is gone (%s); its writes are waited out for %.1f s", self.name, sender[:8], why,
                 self.transport.orphan_lifetime)
        self.keeper.writer_gone(sender, lifetime=self.transport.orphan_lifetime)

    def _undecided(self, sender: str) -> bool:
        """Nothing since the drop tells whether ``sender`` is gone: no session with it again, no other
        sender at the address, no proof taken."""
        return (not self._closed and not self._ready.is_set() and self.sender_id == sender
                and self._gone_sender != sender)

    async def _probe_gone(self, sender: str) -> None:
        """After the control connection dropped: ask the address whether ``sender``'s process is gone (see the
        module docstring), again and again until something tells (a handshake, a refusal, the close). A drop that
        ended a live session (the sender's side closed it while we heard it) needs less proof than one after the
        sender went silent. A verdict counts only for the drop it was asked after: a session that came and went
        while the probe was out makes it ask again (that session's end, not the earlier drop, says how it ended)."""
        delay = PROBE_RETRY_FIRST
        warned = False
        drops = self._drops
        try:
            while self._undecided(sender):
                drops.again = anyio.Event()
                sessions = self.sessions
                verdict = await probe_address(self.address, PROBE_TIMEOUT)
                if not self._undecided(sender):
                    return  # a handshake (or a close) answered meanwhile
                if self.sessions != sessions:
                    continue  # a session came and went while the probe was out
                self.keeper.observer.disconnect_probed(sender=self.address, verdict=verdict.value)
                if verdict is ProbeVerdict.REFUSED:
                    self.sender_gone(sender, f"its address {self.address} refuses connections")
                    return
                if verdict is ProbeVerdict.UNKNOWN and not drops.live:
                    log.warning("%s: the control connection to silent sender %s dropped; %s cannot be asked whether "
                                "anything listens there, so its fenced blocks stay fenced until it comes back, a new "
                                "sender answers there, or declare_sender_gone()", self.name, sender[:8], self.address)
                    return
                if verdict is not ProbeVerdict.ANSWERED and drops.live:
                    self.sender_gone(sender, f"it closed the control connection in a live session, and its address "
                                             f"{self.address} no longer answers ({verdict.value})")
                    return
                # ANSWERED (the sender is there and its handshake is coming, or a new one: a new sender id proves the
                # old gone), or NO_ANSWER after the sender went silent (a host paused or cut off): ask again later,
                # since no drop follows if the process dies before ZeroMQ reconnects.
                if not warned and (verdict is ProbeVerdict.NO_ANSWER or delay > PROBE_RETRY_FIRST):
                    warned = True
                    log.warning("%s: the control connection to sender %s dropped%s, and %s. Its fenced blocks stay "
                                "fenced until it shakes hands again, a new sender answers there, its address refuses "
                                "connections (asked every %.0f-%.0f s), or declare_sender_gone()", self.name,
                                sender[:8], "" if drops.live else " after it went silent",
                                "its address does not answer: its host may be paused or cut off, and its writes "
                                "may still land when it resumes" if verdict is ProbeVerdict.NO_ANSWER else
                                "its address answers but no handshake comes", PROBE_RETRY_FIRST, PROBE_RETRY_MAX)
                with anyio.move_on_after(delay):
                    await drops.again.wait()  # dropped again meanwhile (a session came and went): ask now
                delay = min(PROBE_RETRY_MAX, delay * 2)
        finally:
            if drops.probing == sender:
                drops.probing = None

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self._warnings.warn("frames", "%s: dropped a %d-frame message", self.name, len(frames))
            return
        try:
            msg = decode(frames[0])
        except ProtocolError as exc:
            # Never answer an undecodable frame: two confused peers would bounce errors forever.
            self._warnings.warn("bad", "%s: bad frame from the sender (room=%s): %s", self.name, exc.room, exc)
            if exc.peer_version is not None and not self._answered.is_set():
                self.refused = IncompatiblePeer(f"sender {self.address} speaks protocol version "
                                                f"{exc.peer_version}: {exc}")
                self._answered.set()
                self._nudge.set()
            return
        self.clock.heard(anyio.current_time())
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._warnings.warn("unexpected", "%s: unexpected %s from the sender, ignored", self.name, msg.TYPE)
        else:
            handler(msg)

    def _on_reject(self, msg: Reject) -> None:
        if msg.code == "unknown_peer":
            self._on_unknown_peer(msg)
        elif msg.room is not None:
            self._on_room_frame(msg)
        elif msg.code == "incompatible" and not self._answered.is_set():
            self.refused = IncompatiblePeer(f"sender {self.address} refused the handshake: {msg.reason}")
            self._answered.set()
            self._nudge.set()
        else:
            if not self._answered.is_set():
                # E.g. it could not connect its transport to us, or is busy with max_concurrent_handshakes others
                # (receivers restarting together: never final): HELLO again after the usual back-off, our rooms
                # waiting for the handshake meanwhile.
                self.last_refusal = msg.reason
                self._nudge.set()
            # Budgeted, like a bad frame: a sender may send REJECTs as fast as it likes.
            if msg.code == "busy":
                self._warnings.warn("busy", "%s: the sender is busy with other handshakes (%s); saying HELLO again",
                                    self.name, msg.reason)
            else:
                self._warnings.warn("rejected", "%s: the sender rejected a frame: %s", self.name, msg.reason)

    def _on_fence_release(self, msg: FenceRelease) -> None:
        room = self.rooms.get(msg.room)
        if room is not None and room.writer is not None and room.writer == self.writer:
            # Behind the STATUS(fence=True) it answers, which may still wait in the room's inbox: acted on here
            # first, it found the grant still ANNOUNCED and was ignored, and the STATUS then fenced it for good.
            room.deliver(msg)
            return
        if self.writer is not None:
            self.keeper.fence_released(self.writer, msg.room, settle=FENCE_SETTLE)

    def _on_drained(self, msg: Drained) -> None:
        # It can only vouch for sessions before the one it arrives in: never for the live one. Not while refused:
        # a twin's WELCOME left sender_id naming the sender this connection reached before (see _refuse_twin).
        if self.sender_id is not None and self.ready:
            self.keeper.drained(self.sender_id, min(msg.below_epoch, self.epoch), settle=FENCE_SETTLE)

    def _on_pong(self, msg: Pong) -> None:
        released = self.held_ids.pong(msg.nonce)
        if released:
            self._release_ids()
        if not released and msg.nonce not in self._pings:  # only PINGs of the current session are remembered
            log.debug("%s: PONG %d answers no PING of ours, ignored", self.name, msg.nonce)
        elif self.sender_id is not None and msg.peer_id != self.sender_id:
            self.session_lost(LossKind.DROPPED, f"sender {self.address} restarted (new id {msg.peer_id[:8]})")
        elif msg.epoch != self.epoch:
            self.session_lost(LossKind.DROPPED, f"sender {self.address} no longer knows session {self.epoch} "
                                                "(it declared this receiver dead)")

    def end_barrier(self, room: RoomId) -> None:
        """``room`` ended here with an error: hold its id until the sender answered what we sent about it
        (a PING after the end; its PONG comes after those answers)."""
        if not self.ready:
            return  # the session ended: nothing of it is believed any more
        # If the PING cannot be queued, the session ends (see send()), and every id it held is let go with it.
        self.send(Ping(nonce=self.held_ids.ended(room)))

    async def wait_released(self, room: RoomId) -> None:
        """Until ``room``'s id is no longer held (a new attempt of it sends its INIT only then)."""
        while room in self.held_ids:
            await self._ids_released.wait()

    def _release_ids(self) -> None:
        self._ids_released.set()
        self._ids_released = anyio.Event()

    def _on_ping(self, msg: Ping) -> None:
        self.send(Pong(nonce=msg.nonce, peer_id=self.receiver_id))

    def _on_unknown_peer(self, msg: Reject) -> None:
        # Believed only when it names a room of ours (a real sender answers our INIT/RESUME/ABORT
        # so), or a room the ledger still holds for this sender.
        known = msg.room is not None and (msg.room in self.rooms or (
            self.writer is not None and self.keeper.ledger.holds_room(self.writer, msg.room)))
        if not known:
            self._warnings.warn("unknown_peer", "%s: ignored an unknown_peer REJECT naming no room of ours: %r",
                                self.name, msg.room)
            return
        self.session_lost(LossKind.DROPPED, f"sender {self.address} does not know this session "
                                            "(it restarted, or declared this receiver dead)")

    def _on_room_frame(self, msg: RoomFrame) -> None:
        room_id = msg.room
        assert room_id is not None
        room = self.rooms.get(room_id)
        # A new attempt has no writer until its INIT went out, which waits while the id is held.
        if room is not None and room.writer is not None and room.writer == self.writer:
            room.deliver(msg)
            return
        self._late(msg, room_id)

    def _late(self, msg: RoomFrame, room: RoomId) -> None:
        self.late(msg, room, self.writer)

    def late(self, msg: RoomFrame, room: RoomId, writer: Writer | None) -> None:
        """A frame of ``writer`` for a room no longer in flight here (it arrived after the room ended,
        or was still in the room's inbox when it ended): a proof (or doubt) about fenced blocks."""
        if isinstance(msg, Progress | Total):
            return  # the round goes on: a PROGRESS or TOTAL proves nothing about the end of its writes
        if isinstance(msg, FenceRelease):
            if writer is not None:
                self.keeper.fence_released(writer, room, settle=FENCE_SETTLE)
            return
        if isinstance(msg, Abort):
            self.send(AbortAck(room=room))
        elif self.held_ids.late(msg, room):
            self._release_ids()
        if writer is None:
            return
        if isinstance(msg, Status) and msg.fence:
            self.keeper.late_fence(writer, room)
        elif isinstance(msg, Status):
            data = msg.state in (TransferStatus.SUCCESS, TransferStatus.TRANSFERRING)
            self.keeper.late_answer(writer, room, Proof.STATUS, round=msg.round if data else None,
                                    settle=FENCE_SETTLE)
        elif isinstance(msg, AbortAck):
            self.keeper.late_answer(writer, room, Proof.ABORT_ACK, settle=FENCE_SETTLE)
        elif isinstance(msg, Abort):
            self.keeper.late_answer(writer, room, Proof.SENDER_ABORT, settle=FENCE_SETTLE)
        else:
            # A late REJECT refused some frame of the room (a RESUME that crossed its end, ...), which one it
            # does not say: it proves nothing about the room's fenced blocks (our ABORT's answer frees them).
            log.debug("%s: room=%r: a REJECT after the room ended: %s", self.name, room, msg.reason)
