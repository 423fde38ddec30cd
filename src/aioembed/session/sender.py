"""The encoder side's public face: ``EmbeddingSender``.

The sender does not stage rows into a pool of its own: it registers the caller's tensors with
the transport for the duration of ``send`` and writes straight from them. That saves a full
copy of every request at the price of one registration per request, which is cheap on TCP and
amortised by large requests on RDMA. The tensors must not be modified until ``send`` returns.

The work lives in :mod:`~aioembed.session.send_room` (one room) and
:mod:`~aioembed.session.peer_sessions` (the receivers' sessions); the
:class:`~aioembed.protocol.ownership.WriteLedger` decides when a receiver may be told that writes
into its blocks are over. Like the receiver, the sender can be closed from any task, within
about ``CLOSE_GRACE`` seconds.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NamedTuple, Self

import anyio
import anyio.abc
import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from aioembed.config import TransferConfig
from aioembed.control.channel import ControlSocket
from aioembed.control.sockets import make_router
from aioembed.errors import (
    AioembedError,
    ConfigError,
    InvalidRequest,
    LayoutError,
    PeerDead,
    ProtocolError,
    TransferAborted,
    TransferFailed,
    TransferTimeout,
    TransportError,
    room_prefix,
)
from aioembed.layout import Layout, bytes_are_values, plain_values
from aioembed.log_budget import WarningBudget
from aioembed.memory.device_order import fence_after, wait_fence
from aioembed.memory.staging import StagedRows, StagingArea
from aioembed.metrics import TransferObserver, outcome_of
from aioembed.protocol.messages import (
    MAX_HELLO_BYTES,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Drained,
    FenceRelease,
    Hello,
    Init,
    Message,
    Ping,
    Pong,
    Reject,
    Resume,
    RoomId,
    Status,
    TransferStatus,
    Welcome,
    check_metadata,
    decode,
    encode,
    plain_text,
    validate_room,
)
from aioembed.protocol.ownership import (
    DrainedSession,
    ReleaseSource,
    SendDrained,
    SendFenceRelease,
    SessionKey,
    WriteLedger,
    WriterAction,
)
from aioembed.session.async_library import KnownAsyncLibrary
from aioembed.session.backend import check_backend
from aioembed.session.copy_out import COPY_INLINE_BYTES
from aioembed.session.deadlines import DeadlineTimer, timeout_seconds
from aioembed.session.guarded_observer import GuardedObserver
from aioembed.session.liveness import LoopWatch, PeerClock
from aioembed.session.peer_sessions import PeerDirectory, PeerSession, handshake_problems
from aioembed.session.receiver import CLOSE_GRACE
from aioembed.session.room_deadlines import RoomDeadlines
from aioembed.session.run_once import RunOnce
from aioembed.session.send_room import SendContext, SendRoomDriver
from aioembed.session.source_buffers import RegisteredSources, SourceBufferIndex, check_source_tensors
from aioembed.session.tasks import BackgroundTasks
from aioembed.transports.base import Link, MemoryRegion, Transport
from aioembed.transports.boundary import GuardedTransport, guard
from aioembed.transports.registry import open_configured

__all__ = ["EmbeddingSender"]

STOP_GRACE = 1.0
"""Seconds ``aclose()`` gives the ``send()`` calls whose writes it cancelled (after ``CLOSE_GRACE``) to tell
their ranks that the room ended."""

UNREGISTER_GRACE = 1.0
"""Seconds a ``send()`` waits for the transport to unregister its caller's tensors (also when cancelled); past
that it returns and the sender finishes the unregister in a task of its own."""


class _Ended(NamedTuple):
    """A room's tombstone: who ended it (``"sender"``, ``"receiver"``, or ``"session"``: a rank's session ended
    before its ``send()``, which fails at once if that receiver stays away, see ``_check_lost_rank``; any INIT of
    it clears such a one), why, when; the receivers whose INIT of it is a new request (those that ended it
    themselves, or whose session ended), not a late one; the ranks that had asked for it when it ended (told of its
    end, so their next INIT is a new attempt too); and whether an ``abort()`` or ABORT ended it (not a failure of
    its own ``send()``)."""

    by: str
    reason: str
    at: float
    exempt: frozenset[str]
    ranks: frozenset[int]
    aborted: bool


@dataclass(frozen=True, slots=True)
class _Source:
    """What one ``send()`` writes from: the caller's tensors (registered for it, or, ``regions`` empty, read
    unregistered where the transport can: :meth:`Transport.reads_unregistered`), rows staged in the sender's
    staging area (registered once), or the caller's tensors inside buffers it registered
    (``register_sources()``). Held, its tensors referenced, until no write reads them."""

    regions: list[MemoryRegion]
    tensors: list[torch.Tensor]
    staged: StagedRows | None
    kept: RegisteredSources | None = None


@dataclass(eq=False, slots=True)
class _Registration:
    """The registration of one ``send()``'s own tensors, run in a task the sender owns (see ``_register``)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    registered: bool = False  # the transport registered the regions
    error: Exception | None = None  # what its register() raised
    owner_left: bool = False  # send() ended before it did: the task undoes it and gives the source back
    poke: Callable[[], None] = lambda: None  # wakes the waiting send() (its room's driver) once done


@dataclass(eq=False, slots=True)
class _Unregistration:
    """The unregister of a source no write reads any more, in progress (see ``_run_unregister``): the sender
    keeps the source (and so its tensors) until the transport's ``unregister()`` returned."""

    entry: _Source
    room: RoomId | None  # for logs: the room whose send() it was, if known
    since: float  # anyio.current_time() when it began
    done: anyio.Event = field(default_factory=anyio.Event)
    handed_over: bool = False  # its send() returned before it did


log = logging.getLogger(__name__)

_TOMBSTONES = 4096


class EmbeddingSender:
    """Serves rooms to any number of :class:`~aioembed.EmbeddingReceiver` ranks.

    Binds a ZeroMQ ROUTER at ``bind`` (``tcp://127.0.0.1:0`` picks a free port; read the
    concrete one from :attr:`address`). ``transport`` injects an endpoint instead of opening
    ``config.transport`` (the sender closes it).
    """

    def __init__(self, layout: Layout, config: TransferConfig | None = None, *, bind: str = "tcp://127.0.0.1:0",
                 observer: TransferObserver | None = None, transport: Transport | None = None) -> None:
        self.layout = layout
        # The caller's hooks cannot break a room: what they raise is logged and dropped.
        self.observer: TransferObserver = GuardedObserver(observer) if observer is not None else TransferObserver()
        self.config = config or TransferConfig()
        self.bind = bind
        self.sender_id = uuid.uuid4().hex
        self.address = ""
        self._peers = PeerDirectory()
        self._rooms: dict[RoomId, SendRoomDriver] = {}
        # Recently ended rooms, so the other side learns at once (see _Ended).
        self._ended: OrderedDict[RoomId, _Ended] = OrderedDict()
        self._warnings = WarningBudget(log)  # what peers send that is refused: a flood of it logs one line per window
        self._ledger = WriteLedger()
        self._sources: dict[int, _Source] = {}
        self._unregistering: dict[int, _Unregistration] = {}  # sources whose unregister() has not returned
        self._staging: StagingArea | None = None
        self._unregistered: dict[str, bool] = {}
        """The transport's ``reads_unregistered`` per device, asked once (fixed for the endpoint's life)."""
        self._source_buffers = SourceBufferIndex()
        self._buffer_keys = itertools.count(-1, -1)
        """Keys of registered source buffers being unregistered, in ``_unregistering`` (sends' sources count up)."""
        self._draining: dict[SessionKey, PeerSession] = {}  # dropped sessions whose writes have not ended
        self._handshaking: set[tuple[str, int]] = set()
        self._last_refusal: str | None = None
        self._joined = anyio.Event()  # set (and replaced) whenever a receiver session opens
        self._given_transport = transport
        self._transport: GuardedTransport | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._auth: ThreadAuthenticator | None = None
        self._chan: ControlSocket | None = None
        self._room_ctx: SendContext | None = None
        self._tasks = BackgroundTasks("sender", log)
        self._deadlines = RoomDeadlines()
        self._spawn = self._tasks.spawn
        self._closing = False
        self._closed = anyio.Event()
        self._run_once = RunOnce("sender")
        self._active_sends = 0
        self._idle = anyio.Event()
        self._idle.set()
        # Retire writes that may still land once their transport's write lifetime (of our running time) passed.
        self._timer = DeadlineTimer(self._ledger.next_deadline, lambda now: self._apply(self._ledger.tick(now)),
                                    self._ledger_stalled, stall_tolerance=min(0.5, self.config.heartbeat_interval / 2))
        self._handlers: dict[type, Callable[[PeerSession, Any], None]] = {
            Init: self._on_init, Resume: self._on_resume, Abort: self._on_abort, Reject: self._on_reject,
        }

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._run_once.enter(closing=self._closing)
        cfg = self.config
        if self._given_transport is not None:
            self._transport = guard(self._given_transport)
        else:
            self._transport = await open_configured(cfg)
        try:
            check_backend(self._transport, torch.device("cpu"))
            self._ctx = zmq.Context()
            sock, self.address, self._auth = make_router(self._ctx, self.bind, cfg)
            self._chan = ControlSocket(sock, self._on_frames, name=f"sender@{self.address}", routed=True,
                                       bundles=True)
            if cfg.staging_tokens and not self._reads_unregistered("cpu"):
                await self._open_staging()
            self._room_ctx = SendContext(config=cfg, layout=self.layout, ledger=self._ledger,
                                         transport=self._transport, observer=self.observer, send=self._send_to,
                                         apply=self._apply, last_refusal=lambda: self._last_refusal,
                                         spawn=self._spawn, deadlines=self._deadlines)
            await self._tasks.enter()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._teardown()
            raise
        self._spawn(self._chan.run)
        self._spawn(self._liveness_loop)
        self._spawn(self._timer.run)
        self._spawn(self._deadlines.run)
        log.info("sender: listening on %s (transport %s, id %s)", self.address, self._transport.name,
                 self.sender_id[:8])
        self._run_once.started()
        return self

    async def _open_staging(self) -> None:
        """Register the staging area once; if the transport refuses, every ``send()`` registers its own
        tensors instead (logged: small requests are slower then, nothing else changes)."""
        assert self._transport is not None
        cfg = self.config
        staging = StagingArea(self.layout, cfg.staging_tokens, cfg.staging_max_tokens)
        try:
            await self._transport.register(staging.regions())
        except (TransportError, ConfigError) as exc:
            log.warning("sender: could not register the staging area (%d tokens) with transport %r, so every "
                        "send() registers its own tensors: %s", cfg.staging_tokens, self._transport.name, exc)
            return
        self._staging = staging

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._close()

    async def aclose(self) -> None:
        """Fail rooms in flight (telling their receivers), then close everything. Safe from any task,
        bounded (about ``CLOSE_GRACE`` seconds, plus ``STOP_GRACE`` when writes still running must be
        cancelled), idempotent. One wait is not bounded here: a transport's ``register()`` or ``unregister()``
        in progress (the transport is not closed under it; plugins bound their own)."""
        await self._close()

    async def _close(self) -> None:
        if self._closing:
            with anyio.CancelScope(shield=True):
                await self._closed.wait()
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            try:
                with anyio.move_on_after(CLOSE_GRACE) as grace:
                    for r in list(self._rooms.values()):
                        r.machine.fail("sender closing", aborted=True)
                        r.poke()
                        if not r.active:
                            r.notify_end()
                            self._drop_room(r)  # no send() drives it: told, and forgotten (rooms_in_flight)
                    await self._idle.wait()  # active send() calls notify their ranks
                    if self._chan is not None:
                        await self._chan.drain()  # the final STATUS / ABORT_ACK frames must leave
                if grace.cancelled_caught:
                    # A write that does not end holds its send(): cancel it (a write that may still land is
                    # fenced at its rank), and give the send() calls a moment to tell their ranks.
                    for r in list(self._rooms.values()):
                        r.stop("sender closing")
                    with anyio.move_on_after(STOP_GRACE):
                        await self._idle.wait()
                        if self._chan is not None:
                            await self._chan.drain()
                self._tasks.cancel_all()
                await self._tasks.wait_done(CLOSE_GRACE)
                self._log_stalled_unregisters()
                await self._teardown()
            finally:
                for kept in self._source_buffers.all():  # the closed transport dropped their registrations
                    kept.mark_closed()
                self._closed.set()

    async def _close_link(self, link: Link, peer: object) -> None:
        """Close the link to a receiver that left, was replaced, or at the sender's close. Closing an endpoint to
        a peer that is gone may fail in the plugin (UCX, NIXL): expected, so a budgeted warning, not a bug's
        traceback from the background task."""
        try:
            await link.aclose()
        except TransportError as exc:
            self._warnings.warn("link_close", "sender: closing the link to %s: %s", peer, exc)

    async def _teardown(self) -> None:
        await self._tasks.exit()  # its tasks were cancelled (or never started): the host stops

        async with anyio.create_task_group() as tg:  # at once: a slow close (a frozen peer) holds up no other
            for p in [*self._peers.sessions(), *self._draining.values()]:
                tg.start_soon(self._close_link, p.link, p)
        self._draining.clear()
        if self._chan is not None:
            self._chan.close(linger_ms=200)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            # term() blocks up to the linger (final frames leave): off the loop; destroy() closes any
            # socket left so that it cannot block for ever.
            await anyio.to_thread.run_sync(ctx.destroy, 200)
        if self._transport is not None:
            await self._transport.aclose()
        self._unregistering.clear()  # those whose task could not start: the closed transport dropped them
        # The sources of failed writes that may still land, held for their write lifetime: the closed transport
        # reads them no more (its close waits for or ends every write, and drops their registrations), and no timer
        # runs to release them, so a closed sender would hold the caller's tensors (and staged rows, and a
        # registered buffers' use) for as long as it is referenced. (A send() still running finds its entry gone.)
        for source in list(self._sources):
            self._take_source(source)  # what it returns would be unregistered: the closed transport did that

    def _log_stalled_unregisters(self) -> None:
        now = anyio.current_time()
        stalled = [u for u in self._unregistering.values() if not u.done.is_set()]
        if stalled and self._transport is not None:
            of = ", ".join(repr(u.room) if u.room is not None else "registered buffers" for u in stalled[:5])
            log.warning("sender: closing waits for transport %r's unregister() of %d source(s) (rooms %s; the "
                        "oldest for %.1f s): the transport is not closed under a call in progress",
                        self._transport.name, len(stalled), of, max(now - u.since for u in stalled))

    def _check_running(self, room: RoomId | None = None) -> None:
        """Refuse a call once the sender is closing; ``room``: the room a send() was for (named in the error: one
        of many concurrent sends refused as a server shuts down says which request it was)."""
        if self._closing:
            raise AioembedError(f"{room_prefix(room)}the sender is closing or closed "
                                "(its `async with` block ended, or aclose() was called): it takes no new rooms")
        if not self._tasks.entered:
            raise AioembedError("the sender is not running: use `async with EmbeddingSender(...)`")
        self._run_once.check_thread()

    # -- public API --------------------------------------------------------------------------

    async def send(
        self, room: int | str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None = None,
        *, part: int | None = None, stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Deliver ``tensors`` (one per layout field, same token count) to every expected rank.

        Returns once every rank holds every token; raises a :class:`TransferError` otherwise.
        The tensors are read in place (not copied) and must stay unchanged until this returns. If the
        transport registered them, ``send()`` returns once it unregistered them, or after
        ``UNREGISTER_GRACE`` seconds if its ``unregister()`` stalls: no write reads them then, and the
        sender keeps a reference to them (counted in :attr:`sources_held`) until that call returns.
        ``part``: these rows are part ``part`` of a room the receiver assembles from parts sent by
        several encoders (``receive(room, parts=[...])``): only that part's rows, in token order.

        CUDA tensors are read only once the work queued on ``stream`` (default: the current stream of
        their device, where ``model(x)`` just queued its kernels) has completed: call ``send()`` right
        after the producing kernels, no ``torch.cuda.synchronize()`` needed. Pass ``stream`` if they were
        produced on another stream.
        """
        with KnownAsyncLibrary():
            await self._send_key(self._room_key(room, part), tensors, metadata, stream)

    async def _send_key(self, room: RoomId, tensors: Mapping[str, torch.Tensor],
                        metadata: Mapping[str, Any] | None, stream: torch.cuda.Stream | None = None) -> None:
        """``send()`` of the room (or room part) with wire id ``room``."""
        num_tokens, meta, sources, staged, kept, own = await self._checked_input(room, tensors, metadata, stream)
        r = self._rooms.get(room)
        if r is not None and r.active:
            if staged is not None:
                self._staging_release(staged)
            if kept is not None:
                kept.release()
            raise InvalidRequest(f"room {room!r} is already being sent")
        assert self._room_ctx is not None
        now = anyio.current_time()
        if r is None:
            r = SendRoomDriver(room, self._room_ctx, now)
            self._rooms[room] = r
        source = self._ledger.new_source()
        regions = [MemoryRegion.of_tensor(t) for t in sources] if own else []
        self._sources[source] = _Source(regions, sources, staged, kept)
        r.take_input(sources, source, meta, now)
        self._active_sends += 1
        self._idle = anyio.Event() if self._active_sends == 1 else self._idle
        t_start = time.perf_counter()
        registration = _Registration(poke=r.poke) if own else None
        error: BaseException | None = None
        try:
            r.machine.on_input(num_tokens)
            if registration is not None:
                await self._register(r, source, regions, registration)
            await r.drive()
        except ProtocolError as exc:
            error = TransferFailed(str(exc), room=room)
            raise error from None
        except BaseException as exc:
            error = exc
            raise
        finally:
            await self._send_finished(r, source=source, registration=registration, num_tokens=num_tokens,
                                      t_start=t_start, error=error)

    async def _checked_input(self, room: RoomId, tensors: Mapping[str, torch.Tensor],
                             metadata: Mapping[str, Any] | None, stream: torch.cuda.Stream | None
                             ) -> tuple[int, dict[str, Any], list[torch.Tensor], StagedRows | None,
                                        RegisteredSources | None, bool]:
        """:meth:`_input_of`. A receiver that already asked for the room learns at once, not at its input_timeout,
        that the request was refused or could not be prepared; an exception that is not ours (torch's: out of
        memory making the rows contiguous or staging them) becomes a ``TransferFailed`` naming the room."""
        try:
            return await self._input_of(room, tensors, metadata, stream)
        except (InvalidRequest, LayoutError) as exc:
            if self._room_is_waiting(room):
                self._abort_key(room, f"send() refused the request: {exc}")
            raise
        except AioembedError:
            raise
        except Exception as exc:
            failed = TransferFailed(f"room {room!r}: preparing the request's rows failed: {type(exc).__name__}: "
                                    f"{exc}", room=room)
            if self._room_is_waiting(room):
                self._abort_key(room, f"send() failed: {failed}")
            raise failed from exc
        except BaseException:
            # Cancelled while its rows were made ready (a large copy off the loop, a CUDA producer's stream): as a
            # cancel at any later await, the room ends on both sides (the ranks that asked learn it now).
            if self._room_is_waiting(room):
                self._abort_key(room, "send() was cancelled")
            raise

    async def _input_of(self, room: RoomId, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None,
                        stream: torch.cuda.Stream | None) -> tuple[int, dict[str, Any], list[torch.Tensor],
                                                                   StagedRows | None, RegisteredSources | None, bool]:
        """The request checked, and the tensors its writes read: (tokens, metadata, sources, staged rows, the
        registered source buffers they lie in, acquired for this send, whether this send() registers them)."""
        num_tokens, meta = self._check_request(room, tensors, metadata)
        kept = self._source_buffers.covering(tensors[name] for name in self.layout)
        if kept is not None:
            try:
                return num_tokens, meta, await self._ready_sources(room, tensors, stream), None, kept, False
            except BaseException:
                kept.release()
                raise
        if all(self._reads_unregistered(str(tensors[name].device)) for name in self.layout):
            # Read where they lie: a copy or a registration would only cost time (Mooncake over TCP, UCX without RDMA).
            return num_tokens, meta, await self._ready_sources(room, tensors, stream), None, None, False
        if self._staging is not None:
            staged = self._staging.stage(tensors, num_tokens)
            if staged is not None:
                return num_tokens, meta, list(staged.tensors.values()), staged, None, False
        return num_tokens, meta, await self._ready_sources(room, tensors, stream), None, None, True

    def _reads_unregistered(self, device: str) -> bool:
        known = self._unregistered.get(device)
        if known is None:
            assert self._transport is not None
            known = self._unregistered[device] = self._transport.reads_unregistered(device)
        return known

    async def _ready_sources(self, room: RoomId, tensors: Mapping[str, torch.Tensor],
                             stream: torch.cuda.Stream | None) -> list[torch.Tensor]:
        """``_sources_of``, and the checks that the room may still be sent once they are ready."""
        tomb = self._ended.get(room)
        sources = await self._sources_of(room, tensors, stream)
        if self._closing:  # aclose() began while the sources were being made: it cannot see this room
            raise TransferAborted(f"room {room!r}: aborted: sender closing", room=room)
        ended = self._ended.get(room)
        if ended is not None and ended is not tomb and ended.by == "session":
            self._check_lost_rank(room, ended)  # a rank's session ended while the sources were being made
        if ended is not None and ended is not tomb and ended.aborted:
            # abort() (or a receiver's ABORT) while the sources were being made found no room being sent: it
            # only left this tombstone. Honour it now, or the room would be sent as if it was never aborted.
            if ended.by == "receiver":
                del self._ended[room]
            raise TransferAborted(f"room {room!r} was ended by the {ended.by} while send() prepared its rows: "
                                  f"{ended.reason}", room=room)
        return sources

    @staticmethod
    def _room_key(room: int | str, part: int | None) -> RoomId:
        """The room's wire id: the room itself, or ``(room, part)`` for a part of it."""
        if isinstance(room, (tuple, list)):
            raise InvalidRequest(f"room={room!r}: a room id is an int or a str (name a part with part=)")
        try:
            validate_room("room", room)
            if part is not None:
                return validate_room("room", (room, part))
        except ProtocolError as exc:
            raise InvalidRequest(f"{exc} (part={part!r})" if part is not None else str(exc)) from None
        return room

    def _check_request(self, room: RoomId, tensors: Mapping[str, torch.Tensor],
                       metadata: Mapping[str, Any] | None) -> tuple[int, dict[str, Any]]:
        """Everything about a request that can be refused before a byte moves; (tokens, metadata)."""
        self._check_running(room)
        cfg = self.config
        try:
            num_tokens = self.layout.validate(tensors)
        except LayoutError as exc:  # names a field, not the room: say which of the sends in flight it was
            raise LayoutError(f"room {room!r}: {exc}") from None
        if not 1 <= num_tokens <= cfg.max_request_tokens:
            raise InvalidRequest(f"room {room!r}: {num_tokens} tokens; allowed 1..{cfg.max_request_tokens} "
                                 "(max_request_tokens)")
        if metadata is not None and not isinstance(metadata, Mapping):
            # dict() of it failed (reported as preparing the request's rows) or took a list of pairs, a "" as {}.
            raise InvalidRequest(f"room {room!r}: metadata must be a mapping with str keys (or None), got "
                                 f"{type(metadata).__name__}")
        meta = dict(metadata or {})
        try:
            check_metadata(meta, cfg.max_metadata_bytes)  # the codec's own rules: nothing fails later
        except ProtocolError as exc:
            raise InvalidRequest(f"room {room!r}: {exc} (max_metadata_bytes={cfg.max_metadata_bytes})") from None
        tomb = self._tombstone(room)
        if tomb is not None and tomb.by == "receiver":
            del self._ended[room]
            raise TransferAborted(f"room {room!r} was ended by the receiver before send(): {tomb.reason}", room=room)
        if tomb is not None and tomb.by == "session":
            self._check_lost_rank(room, tomb)
        return num_tokens, meta

    def _check_lost_rank(self, room: RoomId, tomb: _Ended) -> None:
        """``room`` ended with a rank's session before this ``send()`` of it (``tomb``). For a while after the loss
        (``heartbeat_interval x heartbeat_misses``, the time a receiver that was only slow takes to learn of the
        drop and shake hands again), or once the receiver is back (a session, or its handshake under way), the
        ``send()`` waits for an INIT as for any room: the receiver opens a room again when the sender dropped its
        session before any row came, and a router may hand the room to another receiver. Past that, with the
        receiver still away (gone, frozen, cut off) and no INIT of the room since (one would have cleared the
        tombstone), it fails at once (``PeerDead``), not after ``input_timeout`` spent waiting with the caller's
        tensors held; the room then ended as by any failed ``send()``, so a receiver asking for it late is told at
        once, not left waiting for a ``send()`` that failed."""
        cfg = self.config
        back = any(self._peers.of(rid) is not None or any(h == rid for h, _ in self._handshaking)
                   for rid in tomb.exempt)
        if back or anyio.current_time() - tomb.at < cfg.heartbeat_interval * cfg.heartbeat_misses:
            del self._ended[room]
            return
        self._remember_ended(room, "sender", tomb.reason, ranks=tomb.ranks)
        raise PeerDead(f"room {room!r}: a receiver that had asked for it was lost before send() and is not back: "
                       f"{tomb.reason}", room=room)

    async def _register(self, r: SendRoomDriver, source: int, regions: list[MemoryRegion],
                        registration: _Registration) -> None:
        """Register the source; a failure ends the room on both sides.

        A plugin's ``register()`` runs shielded (its engine's books must match what it pinned) and may stall
        on its engine (pinning a large buffer, a wedged driver). So it runs in a task the sender owns, and
        ``send()`` waits for it cancellably and within ``room_timeout``: a registration is never lost to a
        cancel, and a stalled one does not hold ``send()``. If ``send()`` leaves first, that task undoes the
        registration once it completes (the source counts in ``sources_held`` until then)."""
        assert self._transport is not None

        def skipped() -> None:  # never ran (the sender is closing): as if its task was cancelled
            registration.done.set()
            registration.poke()

        self._spawn(self._run_registration, source, regions, registration, if_skipped=skipped)
        m = r.machine
        try:
            with anyio.move_on_after(max(0.0, r.created + self.config.room_timeout - anyio.current_time())):
                # Until it is done, or the room ends meanwhile (abort(), a receiver's ABORT, aclose()).
                while not registration.done.is_set() and not m.state.terminal:
                    await r.wake.wait()
                    r.wake = anyio.Event()
        except BaseException:
            if not m.state.terminal:  # cancelled: the ranks that asked learn it now (drive() never ran)
                m.fail("send() was cancelled", aborted=True)
            r.notify_end()
            raise
        exc = registration.error
        if not registration.done.is_set() and m.state.terminal:  # ended meanwhile: its ranks learn it now
            r.notify_end()
            raise r._failure()
        if not registration.done.is_set():
            message = (f"room {r.room!r}: timed out in phase 'room': transport {self._transport.name!r} did not "
                       f"register the source within room_timeout={self.config.room_timeout} s")
            log.warning("sender: %s (the registration is undone once it completes)", message)
            m.fail(message)
            r.notify_end()
            raise TransferTimeout(message, room=r.room, phase="room")
        if exc is None and not registration.registered:  # its task was cancelled or never ran (aclose())
            m.fail("sender closing", aborted=True)
            r.notify_end()
            raise TransferAborted(f"room {r.room!r}: aborted: sender closing", room=r.room)
        if exc is not None:
            m.fail(f"cannot register the source with transport {self._transport.name!r}: {exc}")
            r.notify_end()  # the receivers learn why at once
            if isinstance(exc, TransportError):
                raise TransferFailed(f"room {r.room!r}: {m.error}", room=r.room) from exc
            raise exc  # a ConfigError names a setting to fix

    async def _run_registration(self, source: int, regions: list[MemoryRegion], registration: _Registration) -> None:
        """``_register``'s task: the plugin's ``register()``, then, if ``send()`` has left, its undoing."""
        assert self._transport is not None
        try:
            await self._transport.register(regions)
            registration.registered = True
        except Exception as exc:  # send() raises it (or logs it below, if it has left)
            registration.error = exc
        finally:
            registration.done.set()
            registration.poke()
            if registration.owner_left:
                entry = self._sources.pop(source, None)
                if registration.registered and entry is not None:
                    log.info("sender: undoing the registration of a source whose send() ended first")
                    await self._run_unregister(source, self._unregistration(source, entry, None))
                elif registration.error is not None:
                    log.warning("sender: registering a source whose send() ended first failed: %s",
                                registration.error)

    def _room_is_waiting(self, room: RoomId) -> bool:
        """A receiver reserved ``room`` and its input has not come (so a refused send() ends it)."""
        r = self._rooms.get(room)
        return r is not None and not r.active and r.machine.total is None

    async def _sources_of(self, room: RoomId, tensors: Mapping[str, torch.Tensor],
                          stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        """The tensors to write from, contiguous and holding their values as bytes (a conjugate view is resolved:
        the transport moves bytes), once they are ready: large CPU copies run off the loop, CUDA ones are queued
        on ``stream`` and waited for (see :mod:`aioembed.memory.device_order`)."""
        caps = self._transport.capabilities if self._transport is not None else None
        # The transport in use, named in a refusal: an injected one, not config.transport (then never opened).
        transport = self._transport.name if self._transport is not None else self.config.transport
        sources = []
        for name in self.layout:
            t = tensors[name]
            cuda = caps is not None and caps.cuda
            if t.device.type not in ("cpu", "cuda") or (t.device.type == "cuda" and not cuda):
                # (Any other device is not CUDA memory: MemoryRegion would name its pointer cuda:N.)
                raise InvalidRequest(f"room {room!r}: field {name!r} is on {t.device}; transport {transport!r} moves "
                                     f"{'CPU and CUDA' if cuda else 'CPU'} memory only")
            if not t.is_contiguous() or not bytes_are_values(t):
                if t.device.type == "cuda":
                    with torch.cuda.stream(stream or torch.cuda.current_stream(t.device)):
                        t = plain_values(t)  # a kernel queued after the producer's: the fence covers both
                elif t.numel() * t.element_size() > COPY_INLINE_BYTES:
                    t = await anyio.to_thread.run_sync(plain_values, t)
                else:
                    t = plain_values(t)
            sources.append(t)
        try:
            fence = fence_after(sources, stream)
        except ValueError as exc:  # fields on several CUDA devices and no stream that orders them all
            raise InvalidRequest(f"room {room!r}: {exc}") from None
        await wait_fence(fence)
        return sources

    async def _send_finished(self, r: SendRoomDriver, *, source: int, registration: _Registration | None,
                             num_tokens: int, t_start: float, error: BaseException | None) -> None:
        """The room's ``send()`` is over (also when it was cancelled: this only awaits shielded, and only for
        the unregister of the caller's own tensors, at most ``UNREGISTER_GRACE``; staged rows are freed at
        once). ``registration``: ``None`` unless this send() registers the caller's tensors (staged rows, registered
        source buffers and sources read unregistered have none)."""
        room = r.room
        rounds = max((p.round + 1 for p in r.machine.ranks.values()), default=0)
        ok = r.machine.state is TransferStatus.SUCCESS
        self.observer.room_finished(
            side="sender", outcome="success" if ok else outcome_of(error or TransferFailed("failed")),
            nbytes=num_tokens * self.layout.bytes_per_token * len(r.machine.ranks), rounds=rounds,
            seconds=time.perf_counter() - t_start)
        if not ok:
            # A rank that asks later learns at once that this room is over; not a receiver that ended it
            # (an ABORT, a REJECT): its next INIT of the room id is a new request (this send() raised).
            self._remember_ended(room, "sender", r.machine.error or "send() did not complete",
                                 exempt=r.ended_by_receivers, ranks=r.rank_peer)
        r.active = False
        r.sources = []
        self._drop_room(r)
        registering = False
        if registration is not None:
            registering = not registration.done.is_set()
            if registering:
                registration.owner_left = True  # its task gives the source back once register() returns
            elif not registration.registered:
                self._sources.pop(source, None)  # nothing was registered, so nothing was written from it
        unregister = None
        later = []
        for action in self._ledger.source_done(source):
            if isinstance(action, ReleaseSource) and action.source == source:
                if not registering:  # no write was started from it: it had not been registered
                    unregister = self._take_source(source)
            else:
                later.append(action)
        self._apply(later)
        if unregister is not None:
            await self._unregister_own(r.room, source, unregister)
        self._active_sends -= 1
        if self._active_sends == 0:
            self._idle.set()

    def _take_source(self, source: int) -> _Source | None:
        """No write reads ``source`` any more: its staged rows are freed now; the caller's own tensors are
        returned, to be unregistered."""
        entry = self._sources.pop(source, None)
        if entry is None:
            return None
        if entry.staged is not None:
            self._staging_release(entry.staged)
            return None
        if entry.kept is not None:
            entry.kept.release()
            return None
        return entry if entry.regions else None  # read unregistered: dropping the tensors is all there is

    async def _release_source(self, source: int) -> None:
        """No write reads ``source`` any more: free its staged rows, or unregister the caller's tensors (a task
        of its own, spawned by ``_apply``)."""
        entry = self._take_source(source)
        if entry is not None:
            await self._run_unregister(source, self._unregistration(source, entry, None))

    async def _unregister_own(self, room: RoomId, source: int, entry: _Source) -> None:
        """The end of ``send()``: unregister its caller's tensors (no write reads them any more).

        A plugin's ``unregister()`` may stall on its engine (a wedged driver, a lock a stuck transfer holds) and
        may shield itself, so it runs in a task the sender owns: ``send()`` waits for it, shielded (a cancel
        does not cut a normal unregister short), up to ``UNREGISTER_GRACE``, then returns; the task finishes
        it and the source counts in ``sources_held`` until then. ``aclose()`` waits for that task."""
        u = self._unregistration(source, entry, room)
        if not self._spawn(self._run_unregister, source, u, if_skipped=u.done.set):
            # The sender is closing: its transport is closed once its tasks ended, which drops the registration;
            # the source is kept (its tensors referenced) until then (a teardown already over let it go).
            if self._closed.is_set():
                self._unregistering.pop(source, None)
            return
        with anyio.CancelScope(shield=True, deadline=anyio.current_time() + UNREGISTER_GRACE):
            await u.done.wait()
        if not u.done.is_set():
            u.handed_over = True
            assert self._transport is not None
            log.warning("sender: room=%r: transport %r's unregister() of the send()'s tensors has not returned "
                        "after %.1f s; send() returns (no write reads them) and the sender finishes the unregister "
                        "when the transport does (the source counts in sources_held until then)", room,
                        self._transport.name, anyio.current_time() - u.since)

    def _unregistration(self, source: int, entry: _Source, room: RoomId | None) -> _Unregistration:
        """``entry`` (out of ``_sources``) held until its unregister returned: it counts in ``sources_held``."""
        u = _Unregistration(entry, room, anyio.current_time())
        self._unregistering[source] = u
        return u

    async def _run_unregister(self, source: int, u: _Unregistration) -> None:
        """Unregister ``u``'s source, shielded (each registration is undone by one unregister: the engine's books
        must match), then let it go."""
        try:
            with anyio.CancelScope(shield=True):
                await self._unregister(u.entry)
        finally:
            if self._unregistering.get(source) is u:
                del self._unregistering[source]
            u.done.set()
            if u.handed_over:
                log.info("sender: room=%r: the transport's unregister() of the send()'s tensors returned after "
                         "%.1f s", u.room, anyio.current_time() - u.since)

    async def _unregister(self, entry: _Source) -> None:
        if self._transport is None:
            return
        try:
            await self._transport.unregister(entry.regions)
        except TransportError as exc:
            log.warning("sender: unregistering a source failed: %s", exc)

    def _staging_release(self, staged: StagedRows) -> None:
        if self._staging is not None:
            self._staging.release(staged)

    async def register_sources(self, *tensors: torch.Tensor) -> RegisteredSources:
        """Register long-lived buffers (contiguous tensors, e.g. an encoder's preallocated outputs) with the
        transport once: a ``send()`` whose every field lies inside them (``buf[:n]`` slices) is written from
        them directly, without the staging copy of a small request or the registration and unregistration
        of the caller's tensors that every other ``send()`` pays (on RDMA, pinning tens of MB costs
        milliseconds per request).

        The buffers stay registered, and referenced, until ``aclose()`` on the returned object (``async
        with await sender.register_sources(...)``) or the sender's close. As with any ``send()``, rows
        must stay unchanged until their ``send()`` returns; ``aclose()`` also waits until no write reads
        the buffers (a failed write that may still be moving holds them for its transport's write
        lifetime). Raises :class:`InvalidRequest` for a tensor that is not contiguous or on a device the
        transport does not move, and :class:`TransportError` if the transport refuses the registration. Not
        cancellable while the transport registers (plugins bound their own calls).
        """
        self._check_running()
        assert self._transport is not None
        regions = check_source_tensors(tensors, cuda=self._transport.capabilities.cuda)
        # In a task the sender owns, so that its close waits for the call rather than closing the transport under
        # it; waited for without a cancel cutting it short: the object is returned with the registration (a
        # cancel reaches the caller at its next await, the object in hand), never a registration without owner.
        done, failed = anyio.Event(), []

        async def register() -> None:
            assert self._transport is not None
            try:
                await self._transport.register(regions)
            except Exception as exc:  # raised to the caller below
                failed.append(exc)
            finally:
                done.set()

        self._spawn(register, if_skipped=done.set)
        with anyio.CancelScope(shield=True):
            await done.wait()
        if failed:
            raise failed[0]
        if self._closing:  # aclose() began meanwhile: the transport's close drops the registration
            raise AioembedError("the sender closed while register_sources() registered the buffers")
        kept = RegisteredSources(tensors, regions, self._start_buffers_close)
        self._source_buffers.add(kept)
        log.info("sender: %d source buffer(s) registered, %d bytes", len(regions), sum(r.length for r in regions))
        return kept

    def _start_buffers_close(self, kept: RegisteredSources) -> None:
        """``RegisteredSources.aclose()`` began: unregister them once no write reads them, in a task the sender
        owns (a cancelled ``aclose()`` does not leave them half closed). Refused once the sender is closing:
        they stay in its index, and its close marks them closed once its transport (which drops them) closed."""
        self._spawn(self._close_buffers, kept)

    async def _close_buffers(self, kept: RegisteredSources) -> None:
        """Cancelled while a write still reads them (the sender closing), this leaves them to the sender's close,
        which marks them closed only once its transport closed: never while a registration that stands is read."""
        await kept.wait_idle()
        self._source_buffers.discard(kept)
        key = next(self._buffer_keys)
        u = self._unregistration(key, _Source(list(kept.regions), list(kept.tensors), None), None)
        try:
            await self._run_unregister(key, u)
        finally:
            kept.mark_closed()

    @property
    def source_buffers(self) -> int:
        """Registered source buffers (``register_sources()``) not yet closed."""
        return len(self._source_buffers)

    def abort(self, room: int | str, reason: str = "aborted by the sender", *, part: int | None = None) -> None:
        """End ``room`` (or part ``part`` of it) without sending it (e.g. the encoder failed on it).

        Ranks that already asked for it are told at once (their ``receive()`` raises
        ``TransferAborted`` with ``reason``); ranks that ask later within ``input_timeout`` are
        told when they ask. A ``send()`` in progress for the room is aborted too.
        """
        self._abort_key(self._room_key(room, part), reason)

    def _abort_key(self, room: RoomId, reason: str) -> None:
        r = self._rooms.get(room)
        if r is not None:
            r.machine.fail(reason, aborted=True)
            if r.active:
                r.poke()  # the driver tells the ranks once its writes are over
                return
            r.notify_end()
            self._drop_room(r)
        # Keep the ranks the room had (a RESUME of theirs that crossed its end is ignored, not refused), also
        # when it had ended already (``abort()`` after a failed ``send()``).
        old = self._tombstone(room)
        ranks = set(r.rank_peer if r is not None else ()) | (old.ranks if old is not None else set())
        if old is not None and old.by == "sender":
            reason = old.reason  # it ended here already: a rank asking later hears the first cause, as one asking did
        self._remember_ended(room, "sender", reason, aborted=True, ranks=ranks)

    def _drop_room(self, r: SendRoomDriver) -> None:
        """Forget ``r``: out of the room table and out of every peer's room set."""
        if self._rooms.get(r.room) is r:
            del self._rooms[r.room]
        for p in r.rank_peer.values():
            p.rooms.discard(r.room)

    # -- the write ledger's actions ------------------------------------------------------------

    def _apply(self, actions: list[WriterAction]) -> None:
        for a in actions:
            if isinstance(a, SendFenceRelease):
                peer = self._peers.of(a.session.receiver)
                if peer is not None and peer.key == a.session:
                    log.info("sender: room=%r: the failed write to %s can no longer land (FENCE_RELEASE)",
                             a.room, peer)
                    self._send_to(peer, FenceRelease(room=a.room))
            elif isinstance(a, SendDrained):
                peer = self._peers.of(a.session.receiver)
                if peer is not None and peer.key == a.session:
                    self._send_to(peer, Drained(below_epoch=a.below_epoch))
            elif isinstance(a, ReleaseSource):
                self._spawn(self._release_source, a.source)
            elif isinstance(a, DrainedSession):
                old = self._draining.pop(a.session, None)
                if old is not None:
                    log.info("sender: the last write into dropped %s ended", old)
                    self._spawn(self._close_link, old.link, old)
        self._timer.wake()

    def _ledger_stalled(self, now: float) -> None:
        assert self._transport is not None
        self._ledger.loop_stalled(now, self._transport.write_lifetime)

    # -- control messages --------------------------------------------------------------------

    def _answer_ended(self, peer: PeerSession, room: RoomId, answer: Message) -> None:
        """Answer ``peer`` about a room this sender does not drive for it (an ABORT_ACK, an ABORTED
        STATUS, a REJECT naming the room): each tells the receiver that no write of the room can reach
        its blocks, and it frees every block of the room it holds fenced. So while a failed write of the
        room into this session may still land (the room ended with ``STATUS(fence=True)`` an instant ago),
        the answer is that fence again: ``FENCE_RELEASE`` follows once the write cannot land."""
        if not self._ledger.in_flight(peer.key, room):
            self._send_to(peer, answer)
            return
        log.info("sender: room=%r: %s to %s held back: a write of the room may still land there (fenced)",
                 room, answer.TYPE, peer)
        if isinstance(answer, Status):
            state, why = answer.state, answer.error or ""
        elif isinstance(answer, Reject):
            state, why = TransferStatus.FAILED, answer.reason
        else:
            state, why = TransferStatus.ABORTED, "aborted"
        self._send_to(peer, Status(room=room, state=state, total_tokens=0, sent_tokens=0, round=0, fence=True,
                                   error=plain_text(f"{why}; a write of this room may still land: its blocks "
                                                    "stay fenced")))
        self._apply(self._ledger.fence_told(peer.key, room))

    def _send_to(self, peer: PeerSession, msg: Message) -> bool:
        """Queue ``msg`` for a live session (never a frame for a session after it ended)."""
        return peer.alive and self._send_identity(peer.identity, msg)

    def _send_identity(self, identity: bytes, msg: Message) -> bool:
        assert self._chan is not None
        try:
            self._chan.send([identity, encode(msg)])
        except AioembedError as exc:  # cannot encode (a bug) or the peer does not read: the caller decides
            # Budgeted: a frozen receiver with many rooms gets a refused frame per STATUS until it is found silent.
            self._warnings.warn("not_sent", "sender: cannot send %s (room %r) to %r: %s", msg.TYPE,
                                getattr(msg, "room", None), identity, exc)
            return False
        return True

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._warnings.warn("frames", "sender: dropped a %d-frame message", len(frames))
            return
        identity, payload = frames
        if len(payload) > MAX_HELLO_BYTES and self._peers.at(identity) is None:
            # Not read: only a HELLO or a PING may come before a session, and neither is this large (a peer
            # flooding us with large valid frames held the loop 0.1 s per frame while each was decoded).
            self._warnings.warn("unread", "sender: a %d-byte frame from %r, which has no session, refused unread",
                                len(payload), identity)
            self._send_identity(identity, Reject(
                reason=f"unknown peer: send HELLO first (a frame of {len(payload)} bytes, more than a HELLO's "
                       f"{MAX_HELLO_BYTES}, refused unread)", code="unknown_peer"))
            return
        try:
            msg = decode(payload)
        except ProtocolError as exc:
            self._warnings.warn("bad", "sender: bad frame from %r (room=%s): %s", identity, exc.room, exc)
            reject = Reject(reason=plain_text(f"bad frame: {exc}"), room=exc.room, code="bad_frame")
            known = self._peers.at(identity)
            if known is not None and exc.room is not None:
                self._refuse_room_frame(known, exc.room, reject)
            else:
                self._send_identity(identity, reject)
            return
        peer = self._peers.at(identity)
        if peer is not None:
            peer.clock.heard(anyio.current_time())
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, Ping):
            epoch = peer.key.epoch if peer is not None else 0  # 0: this socket has no live session
            self._send_identity(identity, Pong(nonce=msg.nonce, peer_id=self.sender_id, epoch=epoch))
        elif peer is None:
            # Never ABORT_ACK a session we do not know: a write into that room from the session we
            # dropped may still be in flight, and the receiver would free its blocks on our word.
            if not isinstance(msg, (Pong, AbortAck, Reject)):
                self._send_identity(identity, Reject(reason="unknown peer: send HELLO first",
                                                     room=getattr(msg, "room", None), code="unknown_peer"))
        else:
            self._on_session_frame(peer, msg)

    def _on_session_frame(self, peer: PeerSession, msg: Message) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            if not isinstance(msg, (Pong, AbortAck)):
                self._warnings.warn("unexpected", "sender: unexpected %s from %s, ignored", msg.TYPE, peer)
            return
        try:
            handler(peer, msg)
        except ProtocolError as exc:
            self._warnings.warn("refused", "sender: room=%s: %s from %s refused: %s", exc.room, msg.TYPE, peer, exc)
            # The reason names the refused frame: the receiver's error says which of its frames broke a rule.
            reject = Reject(reason=plain_text(f"{msg.TYPE} refused: {exc}"), room=exc.room)
            if exc.room is None:
                self._send_to(peer, reject)
            else:
                self._refuse_room_frame(peer, exc.room, reject)

    def _refuse_room_frame(self, peer: PeerSession, room: RoomId, reject: Reject) -> None:
        """Refuse a frame of ``peer`` naming ``room``. The receiver takes the answer as the room's end there (it
        fences the room's blocks, then ABORTs after a REJECT or waits for FENCE_RELEASE after a fence): so a room
        of which ``peer`` is a rank ends here too, at once, or a later write of it would go into those blocks for
        nothing (or into freed ones, with a receiver that frees on a REJECT), and its later frames could reach a
        new attempt of the id. The answer is this rank's last word of the room but the answer to its ABORT or
        the FENCE_RELEASE."""
        self._answer_ended(peer, room, reject)  # a fence instead while a write of the room may still land there
        r = self._rooms.get(room)
        if r is None or r.rank_peer.get(peer.rank) is not peer or peer.rank in r.finished:
            return
        r.finished.add(peer.rank)
        log.warning("sender: room=%r: ended, as %s was told by the refusal of its frame", room, peer)
        self._room_ended_by_receiver(r, peer, f"a frame from {peer} was refused: {reject.reason}",
                                     tombstone=f"a frame from {peer} was refused: {reject.reason}")

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        """Answer a HELLO that needs no connect at once (incompatible, a live session, a repeat of one being
        connected), or start its handshake, unless ``max_concurrent_handshakes`` are under way: each holds a
        transport connect (and the HELLO's descriptor, up to 1 MiB) for up to ``handshake_timeout``, and HELLOs
        with distinct receiver ids (a whole cluster restarting, or one peer inventing ids) started any number of
        them. One beyond the bound is answered ``REJECT(busy)`` at once, neither queued nor dropped: the receiver
        says HELLO again after its back-off, as after a failed connect."""
        cfg = self.config
        assert self._transport is not None
        log.debug("sender: HELLO of receiver %s session %d rank %d (%d handshakes under way)",
                  hello.receiver_id[:8], hello.epoch, hello.rank, len(self._handshaking))
        problems = handshake_problems(hello, self.layout, cfg, self._transport.name)
        if problems:
            reason = f"incompatible receiver (protocol v{PROTOCOL_VERSION}): " + "; ".join(problems)
            # Budgeted: a peer without a session may say HELLO as often as it likes (each one is still answered).
            self._warnings.warn("incompatible", "sender: refused rank %d: %s", hello.rank, reason)
            self._send_identity(identity, Reject(reason=plain_text(reason), code="incompatible"))
            return
        if self._welcome_again(identity, hello):
            return
        key = (hello.receiver_id, hello.epoch)
        if key in self._handshaking:
            return  # a repeated HELLO while we connect to it
        if len(self._handshaking) >= cfg.max_concurrent_handshakes:
            reason = (f"busy: {len(self._handshaking)} handshakes in progress (max_concurrent_handshakes="
                      f"{cfg.max_concurrent_handshakes}); say HELLO again")
            # Budgeted: a burst of restarting receivers (or one peer inventing ids) may send any number of these.
            self._warnings.warn("busy", "sender: HELLO of receiver %s rank %d refused: %s",
                                hello.receiver_id[:8], hello.rank, reason)
            self.observer.handshake_busy()
            self._last_refusal = reason  # a send() waiting for that receiver's INIT says so if it times out
            self._send_identity(identity, Reject(reason=reason, code="busy"))
            return
        self._handshaking.add(key)
        self._spawn(self._handshake, identity, hello, key, if_skipped=lambda: self._handshaking.discard(key))

    async def _handshake(self, identity: bytes, hello: Hello, key: tuple[str, int]) -> None:
        """Connect the transport to the receiver of ``hello`` (counted in ``_handshaking`` under ``key`` until
        it ends), then WELCOME it."""
        cfg = self.config
        assert self._transport is not None
        began = anyio.current_time()
        try:
            with anyio.fail_after(cfg.handshake_timeout):
                link = await self._transport.connect(hello.descriptor)
            log.debug("sender: transport connected to receiver %s session %d in %.3f s", hello.receiver_id[:8],
                      hello.epoch, anyio.current_time() - began)
        except (TransportError, TimeoutError) as exc:
            reason = f"cannot connect transport {self._transport.name!r} to receiver rank {hello.rank}: {exc}"
            self._warnings.warn("connect", "sender: %s", reason)  # budgeted: a HELLO may come as often as a peer likes
            self._last_refusal = reason
            self._send_identity(identity, Reject(reason=plain_text(reason), code="refused"))
            return
        finally:
            self._handshaking.discard(key)
        if self._welcome_again(identity, hello):
            await self._close_link(link, f"receiver {hello.receiver_id[:8]} rank {hello.rank} (a repeated HELLO)")
            return
        old = self._peers.of(hello.receiver_id)
        if old is not None:
            self._session_ended(old, f"{old} was replaced by its session {hello.epoch}")
        on_socket = self._peers.at(identity)
        if on_socket is not None and on_socket is not old:
            # Another receiver id on the same socket: that session would lose its directory entry and
            # linger for good (alive, with its rooms and link), out of reach of liveness and cleanup.
            self._session_ended(on_socket, f"{on_socket} was replaced on its socket by receiver "
                                           f"{hello.receiver_id[:8]}")
        session = PeerSession(identity=identity, key=SessionKey(hello.receiver_id, hello.epoch), rank=hello.rank,
                              world=hello.world, num_blocks=hello.num_blocks, regions=hello.regions, link=link,
                              clock=PeerClock(anyio.current_time()), status_inline_bytes=hello.status_inline_bytes)
        self._peers.add(session)
        self._last_refusal = None
        self._send_identity(identity, Welcome(sender_id=self.sender_id, epoch=hello.epoch,
                                              heartbeat_interval=cfg.heartbeat_interval,
                                              writer_id=self._transport.writer_id))
        self._apply(self._ledger.session_opened(session.key))
        log.info("sender: %s connected (world %d; takes %d bytes of a round's rows inside its STATUS)", session,
                 hello.world, hello.status_inline_bytes)
        self._joined.set()
        self._joined = anyio.Event()

    def _welcome_again(self, identity: bytes, hello: Hello) -> bool:
        """True if ``hello`` repeats the live session (answered again) or is older than it (ignored)."""
        live = self._peers.of(hello.receiver_id)
        if live is None or live.key.epoch < hello.epoch:
            return False
        if live.key.epoch == hello.epoch:
            if live.identity != identity:
                self._peers.move(live, identity)  # its socket reconnected
            assert self._transport is not None
            self._send_to(live, Welcome(sender_id=self.sender_id, epoch=hello.epoch,
                                        heartbeat_interval=self.config.heartbeat_interval,
                                        writer_id=self._transport.writer_id))
        else:
            log.info("sender: ignored a HELLO of session %d from %s (session %d is live)", hello.epoch,
                     live.key.receiver[:8], live.key.epoch)
        return True

    def _on_init(self, peer: PeerSession, msg: Init) -> None:
        room = msg.room
        tomb = self._tombstone(room) if room not in self._rooms else None
        if tomb is not None and tomb.by == "session":
            # Dropped with a rank's session, not ended by anyone: asked for again (that receiver back, another
            # rank, or another receiver the room was handed to), it is a room like any other.
            del self._ended[room]
            tomb = None
        # A room the sender ended (abort(), a failure of its own) is over for any rank asking late. One that
        # receivers ended first (ABORT, REJECT) is over only for a rank of a multi-rank room that had not
        # asked yet: ranks told of its end, and the receivers that ended it, ask again with a new request.
        by_receivers = tomb is not None and (tomb.by == "receiver" or bool(tomb.exempt))
        if tomb is not None and peer.key.receiver not in tomb.exempt and (
                not by_receivers or (msg.expected_ranks > 1 and peer.rank not in tomb.ranks)):
            who = "another rank's receiver" if by_receivers else "the sender"
            self._answer_ended(peer, room, Status(
                room=room, state=TransferStatus.ABORTED, total_tokens=0, sent_tokens=0, round=0,
                error=plain_text(f"{who} ended this room before rank {peer.rank} asked: {tomb.reason}")))
            return
        if msg.expected_ranks != peer.world:
            raise ProtocolError(f"INIT expects {msg.expected_ranks} ranks but {peer} declared world {peer.world}",
                                room=room)
        r = self._rooms.get(room)
        if r is not None and peer.rank in r.finished and r.rank_peer.get(peer.rank) is not peer:
            # This rank was sent the whole room in a session that ended before it heard (its final STATUS lost
            # with it), while other ranks are still served: told so, not refused as a duplicate INIT (bad frame).
            self._answer_ended(peer, room, Status(
                room=room, state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0,
                error=plain_text(f"rank {peer.rank} was sent every token of this room in an earlier session, "
                                 "which ended before it was told; its rows are not sent again")))
            return
        new = r is None
        if r is None:
            if len(peer.rooms) >= self.config.max_rooms_per_peer:
                raise ProtocolError(f"{peer} has {len(peer.rooms)} rooms open; max_rooms_per_peer="
                                    f"{self.config.max_rooms_per_peer}", room=room)
            assert self._room_ctx is not None
            r = SendRoomDriver(room, self._room_ctx, anyio.current_time())
        r.machine.on_init(peer.rank, blocks=msg.blocks, allocated_tokens=msg.allocated_tokens,
                          expected_ranks=msg.expected_ranks, num_blocks=peer.num_blocks,
                          progress_tokens=msg.progress_tokens, exact_tokens=msg.exact_tokens)
        if new:  # only a valid INIT creates a room: refused frames leave nothing behind
            self._rooms[room] = r
        r.rank_peer[peer.rank] = peer
        peer.rooms.add(room)
        self._ended.pop(room, None)
        r.poke()

    def _on_resume(self, peer: PeerSession, msg: Resume) -> None:
        r = self._rooms.get(msg.room)
        if r is None and (tomb := self._tombstone(msg.room)) is not None and peer.rank in tomb.ranks:
            # It crossed the room's end on the wire, and the room is gone already: its final STATUS (or
            # ABORT_ACK) went to this rank and vouches for these blocks too (never written), as while the
            # room was still held (below). A REJECT would prove nothing there, only log a protocol violation.
            log.debug("sender: room=%r: RESUME from %s after the room ended (%s), ignored", msg.room, peer,
                      tomb.reason)
            return
        if r is None or r.rank_peer.get(peer.rank) is not peer:
            raise ProtocolError(f"RESUME for room {msg.room!r}, which {peer} has not started", room=msg.room)
        if r.machine.failed is not None:
            # It crossed the room's end on the wire: the final STATUS (or ABORT_ACK) this rank is owed
            # tells it why, and vouches for the blocks it just announced (never written). A REJECT here
            # would reach it first and hide the room's real cause.
            log.debug("sender: room=%r: RESUME from %s after the room ended (%s), ignored", msg.room, peer,
                      r.machine.error)
            return
        r.machine.on_resume(peer.rank, round=msg.round, sent_tokens=msg.sent_tokens, blocks=msg.blocks,
                            allocated_tokens=msg.allocated_tokens, num_blocks=peer.num_blocks)
        r.poke()

    def _on_abort(self, peer: PeerSession, msg: Abort) -> None:
        r = self._rooms.get(msg.room)
        if r is None or r.rank_peer.get(peer.rank) is not peer:
            self._answer_ended(peer, msg.room, AbortAck(room=msg.room))
            return
        log.info("sender: room=%r: aborted by %s: %s", msg.room, peer, msg.reason)
        if peer.rank in r.finished:
            # It crossed this rank's final STATUS on the wire, and no write goes to it any more: answer now
            # (notify_end skips finished ranks, and the receiver holds the room id until it hears back).
            # After a STATUS(fence=True) the answer is that fence again, and FENCE_RELEASE follows.
            self._answer_ended(peer, msg.room, AbortAck(room=msg.room))
            return
        r.abort_from.add(peer.rank)
        # acknowledged once no write of the room is in flight
        self._room_ended_by_receiver(r, peer, f"aborted by {peer}: {msg.reason}", tombstone=msg.reason, aborted=True)

    def _on_reject(self, peer: PeerSession, msg: Reject) -> None:
        # Budgeted, like a bad frame: a peer may send REJECTs as fast as it likes.
        self._warnings.warn("rejected", "sender: %s rejected a frame (room=%r): %s", peer, msg.room, msg.reason)
        r = self._rooms.get(msg.room) if msg.room is not None else None
        if r is None:
            return
        if r.rank_peer.get(peer.rank) is not peer:
            # Only a rank of the room speaks for it: another receiver's REJECT must not end it for them.
            self._warnings.warn("not_a_rank", "sender: room=%r: REJECT from %s, which is not a rank of the room, "
                                "ignored", msg.room, peer)
            return
        self._room_ended_by_receiver(r, peer, f"{peer} rejected: {msg.reason}",
                                     tombstone=f"{peer} rejected it: {msg.reason}")

    def _room_ended_by_receiver(self, r: SendRoomDriver, peer: PeerSession, failure: str, *, tombstone: str,
                                aborted: bool = False) -> None:
        """``peer``'s ABORT or REJECT ends room ``r`` (``failure``: why, for the room; ``tombstone``: for a
        later ``send()`` of it). A ``send()`` driving it tells the ranks once its writes are over; with none,
        they are told now (not at their input_timeout) and the room is forgotten, remembered as ended by the
        receiver. ``peer``'s next INIT of the room id is a new request, not a late one, if the receivers
        ended the room; not if the sender had ended it already (``abort()``, a failed write: the ABORT
        crossed its end on the wire), whose word then stands: a rank asking again is told at once."""
        if r.machine.failed is None or r.ended_by_receivers:
            r.ended_by_receivers.add(peer.key.receiver)
        r.machine.fail(failure, aborted=aborted)
        if r.active:
            r.poke()
            return
        r.notify_end()
        self._drop_room(r)
        self._remember_ended(r.room, "receiver", tombstone, exempt=r.ended_by_receivers, ranks=r.rank_peer,
                             aborted=True)

    def _remember_ended(self, room: RoomId, by: str, reason: str, *, exempt: Iterable[str] = (),
                        ranks: Iterable[int] = (), aborted: bool = False) -> None:
        self._ended[room] = _Ended(by, reason, anyio.current_time(), frozenset(exempt), frozenset(ranks), aborted)
        self._ended.move_to_end(room)
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)

    def _tombstone(self, room: RoomId) -> _Ended | None:
        """A room ended within the last ``input_timeout`` (older ones may be a new request)."""
        tomb = self._ended.get(room)
        if tomb is not None and anyio.current_time() - tomb.at > self.config.input_timeout:
            del self._ended[room]
            return None
        return tomb

    # -- liveness ----------------------------------------------------------------------------

    async def _liveness_loop(self) -> None:
        cfg = self.config
        interval = cfg.heartbeat_interval
        limit = interval * cfg.heartbeat_misses
        watch = LoopWatch(interval)
        while True:
            expected = anyio.current_time() + interval
            await anyio.sleep(interval)
            now = anyio.current_time()
            starved = watch.woke(now, expected) > 0
            if starved:
                # The transport's engine stalled with us (a frozen process): a write that failed and may still land
                # moves on at the thaw, so its lifetime of running time starts again. The expiry timer sees only a
                # stall it was asleep across its deadline in; one that ended before it woke it on time.
                self._ledger_stalled(now)
                self._timer.wake()
            self._end_silent_sessions(now, limit, starved=starved, interval=interval)

    def _end_silent_sessions(self, now: float, limit: float, *, starved: bool, interval: float) -> None:
        """One look at every session's clock (a method of its own: a loop variable of the liveness loop kept the
        last session it saw, link and all, alive while the loop slept, long after that session ended)."""
        if starved:
            # Our own loop was starved: do not blame peers for silence we could not hear.
            for peer in self._peers.sessions():
                peer.clock.forgive(now, interval)
        for peer in self._peers.sessions():
            if peer.clock.silent(now, limit):
                self._session_ended(peer, f"{peer} silent for more than {limit:.1f} s")

    def _session_ended(self, peer: PeerSession, reason: str) -> None:
        """The session is over: no new write or frame goes to it; its rooms fail. One that no ``send()`` drives
        yet is forgotten, remembered as ended with the session (``reason`` names it): its ``send()``, when it comes,
        fails at once if the receiver stays away (:meth:`_check_lost_rank`); any INIT of it is a new request."""
        def finished(room: RoomId) -> bool:
            # This rank was already told the room's end (its final STATUS, with every token, went out): no write
            # or frame of the room goes to it any more, so its loss is no cause for the other ranks' room to fail
            # (a one-rank room's send() has returned by then, whatever the session does next).
            r = self._rooms.get(room)
            return r is not None and peer.rank in r.finished and r.rank_peer.get(peer.rank) is peer

        done = sum(1 for room in peer.rooms if finished(room))
        log.warning("sender: %s; failing its %d rooms%s", reason, len(peer.rooms) - done,
                    f" ({done} more it was sent in full, still sent to other ranks, go on)" if done else "")
        peer.alive = False
        self._peers.remove(peer)
        self._apply(self._ledger.session_closed(peer.key))
        for room in list(peer.rooms):
            r = self._rooms.get(room)
            if r is None or finished(room):
                continue
            r.machine.fail(reason, peer_lost=True)
            r.poke()
            if not r.active:
                r.notify_end()  # the room's other ranks hold reservations too
                self._drop_room(r)
                self._remember_ended(room, "session", reason, exempt=(peer.key.receiver,), ranks=r.rank_peer)
        peer.rooms.clear()
        if self._ledger.writes_into(peer.key):
            self._draining[peer.key] = peer  # its link closes once its last write ended
        else:
            self._spawn(self._close_link, peer.link, peer)

    async def wait_for_receivers(self, count: int = 1, timeout: float | None = None) -> None:
        """Wait until ``count`` receivers hold a session with this sender (a readiness check); raises
        ``TimeoutError`` after ``timeout`` seconds (default: ``handshake_timeout``)."""
        self._check_running()
        if isinstance(count, bool) or not isinstance(count, int):
            raise InvalidRequest(f"count={count!r} must be an int (how many receivers to wait for)")
        with anyio.fail_after(timeout_seconds("timeout", timeout, self.config.handshake_timeout)):
            while len(self._peers) < count:
                await self._joined.wait()

    # -- introspection -------------------------------------------------------------------------

    @property
    def peers(self) -> list[str]:
        """Connected receivers, for logs and tests."""
        return [str(p) for p in self._peers.sessions()]

    @property
    def rooms_in_flight(self) -> int:
        """Rooms known to the sender (sending, or reserved by a receiver and awaiting ``send``)."""
        return len(self._rooms)

    @property
    def sources_held(self) -> int:
        """``send()`` sources whose memory is still registered, staged or (read unregistered) referenced (its
        ``send()`` runs, or a write may still read it, or the transport's ``unregister()`` of it has not
        returned), and registered source buffers being unregistered; 0 once idle. The staging area and source
        buffers not closed (:attr:`source_buffers`) stay registered while the sender runs and are not counted."""
        return len(self._sources) + len(self._unregistering)

    @property
    def writes_in_flight(self) -> int:
        """Writes not yet known to be over (poisoned ones included until their lifetime passed)."""
        return len(self._ledger)
