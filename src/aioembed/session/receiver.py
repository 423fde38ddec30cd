"""The language side: reserves blocks, asks for rooms, copies rows out, resumes until done.

One task group per receiver owns the control socket's I/O task, the connection task
(handshake and heartbeats) and one task per room. A room's blocks go back to the allocator
only when no write into them can still be in flight: after the sender's final STATUS, after
its ABORT_ACK, or once the sender is declared dead.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
import torch
import zmq
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from aioembed.config import TransferConfig
from aioembed.control.channel import ControlSocket
from aioembed.control.sockets import make_dealer
from aioembed.errors import (
    AioembedError,
    AllocationTimeout,
    IncompatiblePeer,
    InvalidRequest,
    PeerDead,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from aioembed.layout import Layout
from aioembed.memory.allocator import BlockAllocator
from aioembed.memory.pool import BlockPool
from aioembed.metrics import TransferObserver, outcome_of
from aioembed.protocol.messages import (
    Abort,
    AbortAck,
    Hello,
    Init,
    Message,
    Ping,
    Pong,
    Reject,
    Resume,
    RoomId,
    Status,
    Welcome,
    decode,
    encode,
    validate_room,
)
from aioembed.protocol.room import ReceiverRoom, TransferStatus
from aioembed.session.backend import check_backend
from aioembed.session.handle import Lease, Received, ReceiveHandle, TransferStats
from aioembed.transports.base import Transport
from aioembed.transports.registry import open_transport

__all__ = ["EmbeddingReceiver"]

log = logging.getLogger(__name__)

_INBOX = 16
_COPY_INLINE_BYTES = 4 << 20  # below this a copy-out runs on the loop: a thread hop costs more


@dataclass(frozen=True, slots=True)
class _PeerGone:
    reason: str


_Event = Status | Abort | AbortAck | Reject | _PeerGone


def _ends_room(event: _Event) -> bool:
    return isinstance(event, (Abort, Reject, _PeerGone)) or (
        isinstance(event, Status) and event.state in ("FAILED", "ABORTED")
    )


class _Room:
    """Receiver-side bookkeeping of one room (the machine plus its I/O state)."""

    def __init__(self, handle: ReceiveHandle, machine: ReceiverRoom, expected_tokens: int | None) -> None:
        self.handle = handle
        self.machine = machine
        self.expected_tokens = expected_tokens
        send, recv = anyio.create_memory_object_stream[_Event](_INBOX)
        self.inbox_send: MemoryObjectSendStream[_Event] = send
        self.inbox: MemoryObjectReceiveStream[_Event] = recv
        self.blocks: list[int] = []
        self.sender_id: str | None = None
        self.announced = False  # INIT sent: the sender may write into our blocks
        self.sender_ended = False  # the sender told us the room is over (or is gone)
        self.alloc_scope: anyio.CancelScope | None = None  # set while waiting for free blocks
        self.zero_copy = False
        self.reopen = False  # refused by a restarted sender before any data: will be opened again
        self.kept: list[tuple[list[int], int]] = []  # zero-copy: finished rounds' blocks and token counts
        self.round_started = 0.0
        self.out: Mapping[str, torch.Tensor] | None = None  # caller's buffers for copy-out


class EmbeddingReceiver:
    """Receives rooms from one :class:`~aioembed.EmbeddingSender`, as rank ``rank`` of ``world``.

    Use as an async context manager; ``receive(room)`` returns the complete request.
    """

    def __init__(
        self,
        layout: Layout,
        config: TransferConfig | None = None,
        *,
        connect: str,
        rank: int = 0,
        world: int = 1,
        observer: TransferObserver | None = None,
    ) -> None:
        self.layout = layout
        self.observer = observer or TransferObserver()
        self.config = config or TransferConfig()
        if not isinstance(world, int) or not 1 <= world <= 1 << 16:
            raise InvalidRequest(f"world={world!r} must be an int in [1, 65536]")
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise InvalidRequest(f"rank={rank!r} must be an int in [0, world={world})")
        self.connect_to = connect
        self.rank = rank
        self.world = world
        self.peer_id = uuid.uuid4().hex
        self.pool = BlockPool(layout, num_blocks=self.config.pool_blocks, block_size=self.config.block_size,
                              device=self.config.device)
        self.allocator = BlockAllocator(num_blocks=self.config.pool_blocks, block_size=self.config.block_size)
        self._rooms: dict[RoomId, _Room] = {}
        self._orphans: dict[RoomId, list[int]] = {}
        self._transport: Transport | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._chan: ControlSocket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._sender_id: str | None = None
        self._connected = anyio.Event()
        self._rejected: IncompatiblePeer | None = None
        self._welcome_or_reject = anyio.Event()
        self._last_heard = 0.0
        self._copy_limiter = anyio.CapacityLimiter(self.config.copy_threads)
        self._closed = False
        self._closing_hard = False
        self._reconnect = anyio.Event()
        self._ping_nonces: deque[int] = deque(maxlen=8)
        self._nonce_base = uuid.uuid4().int & ((1 << 62) - 1)

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        cfg = self.config
        self._transport = await open_transport(cfg.transport, cfg.transport_options)
        try:
            check_backend(self._transport, self.pool.device)
            await self._transport.register(self.pool.regions())
            self._ctx = zmq.Context()
            sock = make_dealer(self._ctx, self.connect_to, cfg)
            self._chan = ControlSocket(sock, self._on_frames, name=f"receiver[{self.rank}]->{self.connect_to}")
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        except BaseException:
            await self._teardown()
            raise
        self._tg.start_soon(self._chan.run)
        self._tg.start_soon(self._connection_loop)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abort rooms in flight (bounded wait for the sender's ABORT_ACK), then close everything."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for r in list(self._rooms.values()):
                r.handle.cancel("receiver closing")
            with anyio.move_on_after(self.config.handshake_timeout):
                for r in list(self._rooms.values()):
                    await r.handle.wait()
        self._closing_hard = True
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            await self._teardown()

    async def _teardown(self) -> None:
        if self._chan is not None:
            self._chan.close()
        if self._ctx is not None:
            self._ctx.term()
        if self._transport is not None:
            await self._transport.aclose()

    @property
    def connected(self) -> bool:
        """True while a handshake with the sender holds."""
        return self._connected.is_set()

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait for the handshake (default deadline: ``handshake_timeout``)."""
        t = self.config.handshake_timeout if timeout is None else timeout
        try:
            with anyio.fail_after(t):
                await self._connected.wait()
        except TimeoutError:
            raise TransferTimeout(f"no handshake with sender {self.connect_to} within {t} s",
                                  phase="handshake") from None
        if self._rejected is not None:
            raise self._rejected

    # -- public API ----------------------------------------------------------------------

    def start(self, room: RoomId, *, expected_tokens: int | None = None, zero_copy: bool = False,
              out: Mapping[str, torch.Tensor] | None = None) -> ReceiveHandle:
        """Begin receiving ``room``; returns at once with a handle.

        With ``zero_copy`` the result is a :class:`Lease` on pool blocks (``handle.lease()``)
        instead of freshly allocated tensors (``handle.result()``). With ``out``, rows are copied
        into the caller's tensors (one per field, enough rows, contiguous; reusing buffers saves
        the page faults of fresh allocations) and ``result().tensors`` are views of them.
        """
        if out is not None:
            if zero_copy:
                raise InvalidRequest("out= and zero_copy=True exclude each other")
            if set(out) != set(self.layout):
                raise InvalidRequest(f"out= needs exactly the fields {list(self.layout)}, got {list(out)}")
            for name, f in self.layout.items():
                t = out[name]
                if t.dtype != f.dtype or tuple(t.shape[1:]) != f.shape or not t.is_contiguous():
                    raise InvalidRequest(f"out[{name!r}] must be contiguous {f.dtype} of shape (n, "
                                         f"{', '.join(map(str, f.shape))}), got {t.dtype} {tuple(t.shape)}")
        if self._tg is None or self._closed:
            raise AioembedError("the receiver is not running: use `async with EmbeddingReceiver(...)`")
        try:
            validate_room("room", room)
        except ProtocolError as exc:
            raise InvalidRequest(str(exc)) from None
        if room in self._rooms or room in self._orphans:
            raise InvalidRequest(f"room {room!r} is already being received")
        if expected_tokens is not None and (
            not isinstance(expected_tokens, int) or not 1 <= expected_tokens <= self.config.max_request_tokens
        ):
            raise InvalidRequest(f"expected_tokens={expected_tokens!r} must be in "
                                 f"[1, max_request_tokens={self.config.max_request_tokens}]")
        handle = ReceiveHandle(room)
        machine = ReceiverRoom(room, block_size=self.config.block_size, max_tokens=self.config.max_request_tokens)
        r = _Room(handle, machine, expected_tokens)
        r.zero_copy = zero_copy
        r.out = out
        self._rooms[room] = r
        handle._scope = anyio.CancelScope()
        self._tg.start_soon(self._run_room, r)
        return handle

    async def receive(self, room: RoomId, *, expected_tokens: int | None = None,
                      out: Mapping[str, torch.Tensor] | None = None) -> Received:
        """Receive ``room`` completely. Cancelling this call aborts the room on both sides.

        ``out``: optional preallocated tensors to copy into (see :meth:`start`).
        """
        handle = self.start(room, expected_tokens=expected_tokens, out=out)
        try:
            return await handle.result()
        except anyio.get_cancelled_exc_class():
            handle.cancel("receive() was cancelled")
            raise

    async def receive_leased(self, room: RoomId, *, expected_tokens: int | None = None) -> Lease:
        """Receive ``room`` without copying it out of the pool: the rows stay in pool blocks,
        exposed as views under a :class:`Lease`. Release the lease promptly (``lease.release()``
        or ``async with lease:``): its blocks are unavailable to other rooms until then.

        The whole request must fit the pool at once; a larger one fails with ``TransferFailed``.
        """
        handle = self.start(room, expected_tokens=expected_tokens, zero_copy=True)
        try:
            return await handle.lease()
        except anyio.get_cancelled_exc_class():
            handle.cancel("receive_leased() was cancelled")
            raise

    # -- control messages ----------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        assert self._chan is not None
        self._chan.send([encode(msg)])

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            log.warning("receiver[%d]: dropped a %d-frame message from the sender", self.rank, len(frames))
            return
        try:
            msg = decode(frames[0])
        except ProtocolError as exc:
            # Never answer an undecodable frame: two confused peers would bounce errors forever.
            log.warning("receiver[%d]: bad frame from sender (room=%s): %s", self.rank, exc.room, exc)
            if exc.peer_version is not None and not self._connected.is_set():
                self._rejected = IncompatiblePeer(
                    f"sender {self.connect_to} speaks protocol version {exc.peer_version}: {exc}")
                self._welcome_or_reject.set()
            return
        self._last_heard = anyio.current_time()
        if isinstance(msg, Welcome):
            if self._sender_id is None:
                self._sender_id = msg.peer_id
                self._welcome_or_reject.set()
        elif isinstance(msg, Reject) and msg.code == "unknown_peer":
            # The sender does not know us: it restarted. Re-handshake at once; a room it refused
            # before any data arrived is opened again rather than failed. Believed only when it
            # names a room of ours (a real restarted sender answers our INIT/RESUME/ABORT so).
            if msg.room is None or (msg.room not in self._rooms and msg.room not in self._orphans):
                log.warning("receiver[%d]: ignored an unknown_peer REJECT naming no room of ours: %r",
                            self.rank, msg.room)
                return
            r = self._rooms.get(msg.room)
            if r is not None and r.machine.received == 0:
                r.reopen = True
                self._deliver(r, msg)
            if self._connected.is_set():
                self._sender_lost("the sender does not know this receiver (it restarted)")
            elif r is not None and not r.reopen:
                self._deliver(r, msg)
        elif isinstance(msg, Reject) and msg.room is None:
            if not self._connected.is_set() and msg.code == "incompatible":
                self._rejected = IncompatiblePeer(f"sender {self.connect_to} refused the handshake: {msg.reason}")
                self._welcome_or_reject.set()
            else:
                log.warning("receiver[%d]: sender rejected a frame: %s", self.rank, msg.reason)
        elif isinstance(msg, (Status, Abort, AbortAck, Reject)):
            room = msg.room
            assert room is not None
            r = self._rooms.get(room)
            if r is None:
                if isinstance(msg, Abort):
                    self._send(AbortAck(room=room))
                elif room in self._orphans and (
                    isinstance(msg, AbortAck) or (isinstance(msg, Status) and not msg.fence)
                ):
                    self._release_orphan(room, f"late {msg.TYPE}")
                else:
                    log.debug("receiver[%d]: room=%r: %s for a room not in flight, ignored", self.rank, room, msg.TYPE)
                return
            self._deliver(r, msg)
        elif isinstance(msg, Pong):
            if msg.nonce not in self._ping_nonces:
                log.debug("receiver[%d]: PONG %d answers no PING of ours, ignored", self.rank, msg.nonce)
            elif self._sender_id is not None and msg.peer_id != self._sender_id:
                self._sender_lost(f"sender {self.connect_to} restarted (new peer id)")
        elif isinstance(msg, Ping):
            self._send(Pong(nonce=msg.nonce, peer_id=self.peer_id))
        else:
            log.warning("receiver[%d]: unexpected %s from the sender, ignored", self.rank, msg.TYPE)

    def _deliver(self, r: _Room, event: _Event) -> None:
        try:
            r.inbox_send.send_nowait(event)
            if r.alloc_scope is not None and _ends_room(event):
                r.alloc_scope.cancel()  # stop waiting for memory: the room is over
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            log.debug("receiver[%d]: room=%r: %s after the room ended, ignored", self.rank, r.handle.room, event)
        except anyio.WouldBlock:
            log.error("receiver[%d]: room=%r: sender flooded the room with messages; failing it",
                      self.rank, r.handle.room)
            r.handle.cancel("sender sent more messages than the protocol allows")

    def _release_orphan(self, room: RoomId, why: str) -> None:
        blocks = self._orphans.pop(room, None)
        if blocks:
            log.info("receiver[%d]: room=%r: releasing %d fenced blocks (%s)", self.rank, room, len(blocks), why)
            self.allocator.free(blocks)

    def _sender_lost(self, reason: str) -> None:
        """The sender died or restarted: nothing more will be written; end every room."""
        if self._sender_id is None and not self._connected.is_set():
            return
        log.warning("receiver[%d]: %s; failing %d rooms", self.rank, reason, len(self._rooms))
        self._sender_id = None
        self._connected = anyio.Event()
        self._welcome_or_reject = anyio.Event()
        for r in list(self._rooms.values()):
            if r.announced and not r.reopen:
                self._deliver(r, _PeerGone(reason))
        for room in list(self._orphans):
            self._release_orphan(room, reason)
        self._reconnect.set()

    async def _connection_loop(self) -> None:
        cfg, transport = self.config, self._transport
        assert transport is not None
        while True:
            self._reconnect = anyio.Event()
            # Handshake: HELLO until WELCOME or REJECT (the sender may not be up yet).
            self.peer_id = uuid.uuid4().hex  # a new session id tells the sender to drop the old one
            hello = Hello(
                peer_id=self.peer_id, fingerprint=self.layout.fingerprint, transport=cfg.transport,
                descriptor=transport.descriptor(), block_size=cfg.block_size,
                num_blocks=cfg.pool_blocks, rank=self.rank, world=self.world,
                regions=tuple((reg.address, reg.length) for reg in self.pool.regions()),
            )
            while not self._welcome_or_reject.is_set():
                self._send(hello)
                with anyio.move_on_after(cfg.handshake_timeout):
                    await self._welcome_or_reject.wait()
                if not self._welcome_or_reject.is_set():
                    log.info("receiver[%d]: no answer from sender %s yet; saying HELLO again",
                             self.rank, self.connect_to)
            if self._rejected is not None:
                log.error("receiver[%d]: %s", self.rank, self._rejected)
                self._connected.set()  # wakes waiters, who then see the rejection
                return
            log.info("receiver[%d]: connected to sender %s", self.rank, self.connect_to)
            self._last_heard = anyio.current_time()
            self._connected.set()
            # Heartbeats: the only timer in the library.
            nonce = 0
            limit = cfg.heartbeat_interval * cfg.heartbeat_misses
            last_tick = anyio.current_time()
            while not self._reconnect.is_set():
                nonce += 1
                ping = (self._nonce_base + nonce) & ((1 << 62) - 1)  # unguessable, so PONGs can be checked
                self._ping_nonces.append(ping)
                self._send(Ping(nonce=ping))
                with anyio.move_on_after(cfg.heartbeat_interval):
                    await self._reconnect.wait()
                now = anyio.current_time()
                if now - last_tick > 2 * cfg.heartbeat_interval:
                    # Our own loop was starved: do not blame the sender for silence we could not hear.
                    self._last_heard = max(self._last_heard, now - cfg.heartbeat_interval)
                last_tick = now
                if now - self._last_heard > limit:
                    self._sender_lost(f"sender {self.connect_to} silent for more than {limit:.1f} s")

    # -- one room ------------------------------------------------------------------------

    def _reserve_tokens(self, r: _Room, remaining: int | None, *, shrink: bool = True) -> int:
        cfg = self.config
        if remaining is None:  # first reservation: never into the slice kept for resume rounds
            want = r.expected_tokens if r.expected_tokens is not None else cfg.default_tokens
            return min(want, cfg.round_tokens, cfg.pool_tokens - cfg.resume_reserve)
        want = min(remaining, cfg.round_tokens)
        bs = cfg.block_size
        free_tokens = self.allocator.stats.free * bs
        if shrink and want > free_tokens:
            # The pool is short: take a smaller round now rather than wait for a big one that
            # may never come free (other blocks may be held by rooms still waiting for input).
            floor = min(want, max(cfg.resume_reserve, bs))
            want = max(floor, free_tokens // bs * bs)
        return want

    async def _phase_wait(self, r: _Room, phase: str, timeout: float) -> _Event:
        try:
            with anyio.fail_after(timeout):
                return await r.inbox.receive()
        except TimeoutError:
            raise TransferTimeout(
                f"room {r.handle.room!r}: timed out after {timeout} s in phase {phase!r} "
                f"(receiver rank {self.rank}, sender {self.connect_to})", room=r.handle.room, phase=phase,
            ) from None

    async def _alloc(self, r: _Room, tokens: int, phases: dict[str, float]) -> list[int]:
        t0 = time.perf_counter()
        blocks: list[int] = []
        first = not r.announced
        keep = 0 if not first else self.config.resume_reserve // self.config.block_size
        try:
            with anyio.CancelScope() as scope:
                r.alloc_scope = scope
                blocks = await self.allocator.alloc(tokens, timeout=self.config.round_timeout,
                                                    priority=not first, keep_free=keep)
        except AllocationTimeout as exc:
            raise TransferTimeout(f"room {r.handle.room!r}: {exc}", room=r.handle.room, phase="allocate") from None
        finally:
            r.alloc_scope = None
        phases["allocate"] = phases.get("allocate", 0.0) + time.perf_counter() - t0
        return blocks  # empty if the wait was interrupted by the end of the room (now in the inbox)

    def _output(self, r: _Room, total: int) -> dict[str, torch.Tensor]:
        if r.out is None:
            return self.layout.empty(total, device=self.pool.device)
        short = {n: int(t.shape[0]) for n, t in r.out.items() if t.shape[0] < total}
        if short:
            raise TransferFailed(f"room {r.handle.room!r}: the request has {total} tokens but out= holds only "
                                 f"{short}", room=r.handle.room)
        return {n: t[:total] for n, t in r.out.items()}

    def _send_resume(self, r: _Room, tokens: int) -> None:
        m = r.machine
        m.resume_sent(blocks=len(r.blocks), allocated_tokens=tokens)
        self._send(Resume(room=m.room, round=m.round, sent_tokens=m.received, blocks=tuple(r.blocks),
                          allocated_tokens=tokens))
        r.round_started = time.perf_counter()
        log.debug("receiver[%d]: room=%r: RESUME round %d, %d/%s tokens in, %d reserved",
                  self.rank, m.room, m.round, m.received, m.total, tokens)

    def _lease_views(self, kept: list[tuple[list[int], int]]) -> dict[str, list[torch.Tensor]]:
        views: dict[str, list[torch.Tensor]] = {name: [] for name in self.layout}
        for blocks, count in kept:
            for name, vs in self.pool.views(blocks, count).items():
                views[name].extend(vs)
        return views

    async def _copy_out(self, blocks: list[int], out: dict[str, torch.Tensor], start: int, count: int) -> None:
        nbytes = count * self.layout.bytes_per_token
        if nbytes <= _COPY_INLINE_BYTES or self.pool.device.type != "cpu":
            self.pool.copy_out(blocks, count, out, out_start=start)
            if self.pool.device.type != "cpu":
                await anyio.to_thread.run_sync(torch.cuda.synchronize, self.pool.device,
                                               limiter=self._copy_limiter)
        else:
            # Split by whole blocks across the copy threads: a large copy-out into fresh memory is
            # dominated by page faults and memory bandwidth, which several cores share out.
            bs = self.pool.block_size
            parts = max(1, min(self.config.copy_threads, nbytes // _COPY_INLINE_BYTES))
            per = -(-len(blocks) // parts)

            def part(b0: int) -> None:
                n = min(count - b0 * bs, per * bs)
                self.pool.copy_out(blocks[b0:b0 + per], n, out, out_start=start + b0 * bs)

            async with anyio.create_task_group() as tg:
                for b0 in range(0, len(blocks), per):
                    if count - b0 * bs > 0:
                        tg.start_soon(functools.partial(anyio.to_thread.run_sync, part, b0,
                                                        limiter=self._copy_limiter))

    async def _open(self, r: _Room, phases: dict[str, float]) -> None:
        """Handshake (if needed), first reservation, INIT."""
        room, m = r.handle.room, r.machine
        while True:
            t0 = time.perf_counter()
            await self.wait_connected()
            phases["handshake"] = phases.get("handshake", 0.0) + time.perf_counter() - t0
            r.sender_id = self._sender_id
            tokens = self._reserve_tokens(r, None)
            r.blocks = await self._alloc(r, tokens, phases)
            if not r.blocks:
                raise TransferFailed(f"room {room!r}: reservation interrupted", room=room)
            if self._connected.is_set() and self._sender_id == r.sender_id:
                break
            self._free(r)  # the sender went away while we waited for blocks: meet the next one first
        self._send(Init(room=room, blocks=tuple(r.blocks), allocated_tokens=tokens, expected_ranks=self.world))
        r.round_started = time.perf_counter()
        r.announced = True
        m.init_sent(blocks=len(r.blocks), allocated_tokens=tokens)
        r.handle._set_status(TransferStatus.WAITING_FOR_INPUT)
        log.debug("receiver[%d]: room=%r: INIT %d tokens in %d blocks", self.rank, room, tokens, len(r.blocks))

    async def _run_room(self, r: _Room) -> None:
        h, m, cfg = r.handle, r.machine, self.config
        room = h.room
        t_start = time.perf_counter()
        phases: dict[str, float] = {}
        out: dict[str, torch.Tensor] | None = None
        metadata: dict[str, Any] = {}
        error: TransferError | None = None
        result: Received | Lease | None = None
        assert h._scope is not None
        try:
            with h._scope:
                try:
                    with anyio.fail_after(cfg.room_timeout):
                        await self._open(r, phases)
                        retries = 0
                        phase, timeout = "input", cfg.input_timeout
                        while True:
                            t0 = time.perf_counter()
                            event = await self._phase_wait(r, phase, timeout)
                            phases["wait"] = phases.get("wait", 0.0) + time.perf_counter() - t0
                            if _ends_room(event):
                                r.sender_ended = True
                            if isinstance(event, _PeerGone):
                                self._free(r)
                                raise PeerDead(f"room {room!r}: {event.reason}", room=room)
                            if isinstance(event, Abort):
                                m.abort(event.reason)
                                self._free(r)  # the sender sends ABORT only once its writes are over
                                self._send(AbortAck(room=room))
                                raise TransferAborted(f"room {room!r}: aborted by the sender: {event.reason}",
                                                      room=room)
                            if isinstance(event, Reject) and r.reopen and retries < 3:
                                # A restarted sender never saw this room: nothing was written. Start over.
                                log.info("receiver[%d]: room=%r: sender restarted before the room began; "
                                         "opening it again", self.rank, room)
                                retries += 1
                                self._free(r)
                                r.announced = r.sender_ended = False
                                r.machine = m = ReceiverRoom(room, block_size=cfg.block_size,
                                                             max_tokens=cfg.max_request_tokens)
                                h._set_status(TransferStatus.BOOTSTRAPPING)
                                r.reopen = False
                                await self._open(r, phases)
                                continue
                            if isinstance(event, Reject):
                                m.fail(event.reason)
                                self._free(r)  # a rejected reservation is never written
                                raise TransferFailed(f"room {room!r}: sender rejected it: {event.reason}",
                                                     room=room)
                            if isinstance(event, AbortAck):
                                raise ProtocolError(f"room {room!r}: ABORT_ACK without an ABORT", room=room)
                            arrived = m.on_status(event)
                            if arrived is None and event.fence:
                                self._orphan(r, "the sender's failed write may still land")
                            if arrived is None:
                                self._free(r)  # a final FAILED/ABORTED STATUS: no write is in flight
                                cls = TransferAborted if m.state is TransferStatus.ABORTED else TransferFailed
                                raise cls(f"room {room!r}: sender reported {m.state.name}: {m.error}", room=room)
                            h._set_status(TransferStatus.TRANSFERRING)
                            self.observer.round_finished(side="receiver",
                                                         seconds=time.perf_counter() - r.round_started)
                            done_blocks, r.blocks = r.blocks, []  # written and announced: safe to read
                            if arrived.complete:
                                r.sender_ended = True
                                metadata = dict(arrived.metadata or {})
                            else:
                                # Reserve the next round first, so the sender writes it while we copy
                                # this one out; wait for memory only if the pool is short.
                                tokens = self._reserve_tokens(r, arrived.remaining, shrink=False)
                                if r.zero_copy and arrived.total > self.pool.num_tokens:
                                    r.kept.append((done_blocks, arrived.count))
                                    raise TransferFailed(
                                        f"room {room!r}: {arrived.total} tokens cannot be received zero-copy "
                                        f"into a pool of {self.pool.num_tokens} tokens; use receive()", room=room)
                                early = self.allocator.try_alloc(tokens, priority=True)
                                if early is not None:
                                    r.blocks = early
                                    self._send_resume(r, tokens)
                            if r.zero_copy:
                                r.kept.append((done_blocks, arrived.count))
                            else:
                                t0 = time.perf_counter()
                                try:
                                    if out is None:
                                        out = self._output(r, arrived.total)
                                    await self._copy_out(done_blocks, out, arrived.start, arrived.count)
                                finally:
                                    self.allocator.free(done_blocks)  # announced and read (or given up)
                                phases["copy"] = phases.get("copy", 0.0) + time.perf_counter() - t0
                            if arrived.complete:
                                break
                            if not r.blocks:
                                tokens = self._reserve_tokens(r, arrived.remaining)  # now, with this round freed
                                r.blocks = await self._alloc(r, tokens, phases)
                                if not r.blocks:
                                    phase, timeout = "round", cfg.round_timeout
                                    continue  # the room ended while we waited for memory: read why
                                self._send_resume(r, tokens)
                            phase, timeout = "round", cfg.round_timeout
                    assert m.total is not None
                    stats = TransferStats(bytes=m.total * self.layout.bytes_per_token, rounds=m.round + 1,
                                          seconds=time.perf_counter() - t_start, phases=phases)
                    if r.zero_copy:
                        kept, r.kept = r.kept, []
                        result = Lease(room=room, views=self._lease_views(kept), metadata=metadata,
                                       num_tokens=m.total, rounds=m.round + 1, stats=stats,
                                       release=lambda: self.allocator.free([b for bl, _ in kept for b in bl]))
                    else:
                        assert out is not None
                        result = Received(room=room, tensors=out, metadata=metadata, num_tokens=m.total,
                                          rounds=m.round + 1, stats=stats)
                except TimeoutError as exc:
                    if isinstance(exc, TransferError):
                        raise
                    raise TransferTimeout(f"room {room!r}: exceeded room_timeout={cfg.room_timeout} s",
                                          room=room, phase="room") from None
        except TransferError as exc:
            error = exc
        except ProtocolError as exc:
            error = TransferFailed(f"room {room!r}: protocol violation by the sender: {exc}", room=room)
        except Exception as exc:  # a bug: fail the room loudly, keep the receiver alive
            log.exception("receiver[%d]: room=%r: internal error", self.rank, room)
            error = TransferFailed(f"room {room!r}: internal error: {exc!r}", room=room)
        finally:
            with anyio.CancelScope(shield=True):
                if result is None and error is None:
                    reason = h._cancel_reason or "cancelled"
                    error = TransferAborted(f"room {room!r}: {reason}", room=room)
                if error is not None:
                    await self._end_failed(r, error)
                if r.kept:  # zero-copy rounds of a failed room: fully written, nothing in flight
                    self.allocator.free([b for blocks, _ in r.kept for b in blocks])
                    r.kept = []
                self._rooms.pop(room, None)
                r.inbox_send.close()
                r.inbox.close()
                self.observer.room_finished(
                    side="receiver", outcome=outcome_of(error if result is None else None),
                    nbytes=(m.total or 0) * self.layout.bytes_per_token, rounds=m.round + 1,
                    seconds=time.perf_counter() - t_start)
                if result is not None:
                    h._finish(result=result, status=TransferStatus.SUCCESS)
                    log.debug("receiver[%d]: room=%r: done, %d tokens in %d rounds",
                              self.rank, room, result.num_tokens, result.rounds)
                else:
                    assert error is not None
                    status = TransferStatus.ABORTED if isinstance(error, TransferAborted) else TransferStatus.FAILED
                    h._finish(error=error, status=status)
                    log.info("receiver[%d]: room=%r: %s: %s", self.rank, room, status.name, error)

    def _orphan(self, r: _Room, why: str, *, fenced: bool = False, level: int = logging.WARNING) -> None:
        """Keep the room's blocks fenced until the sender is gone: a write may still land in them."""
        if r.blocks:
            log.log(level, "receiver[%d]: room=%r: %d blocks stay fenced until the sender is gone (%s)",
                    self.rank, r.handle.room, len(r.blocks), why)
            if not fenced:
                self.allocator.fence(r.blocks)
            self._orphans[r.handle.room] = r.blocks
            r.blocks = []

    def _free(self, r: _Room) -> None:
        if r.blocks:
            blocks, r.blocks = r.blocks, []
            self.allocator.free(blocks)

    async def _end_failed(self, r: _Room, error: TransferError) -> None:
        """Tell the sender (if it knows the room) and release the blocks once no write can land."""
        room = r.handle.room
        r.machine.fail(str(error))
        if not r.announced or r.sender_ended or r.sender_id != self._sender_id:
            self._free(r)  # never announced, already ended by the sender, or that sender is gone
            return
        self._send(Abort(room=room, reason=str(error)[:4000]))
        if not r.blocks:
            return  # between rounds: nothing of ours can be written
        self.allocator.fence(r.blocks)
        wait = 0.0 if self._closing_hard else self.config.round_timeout
        with anyio.move_on_after(wait):
            while True:
                try:
                    event = await r.inbox.receive()
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                if isinstance(event, Status) and event.fence:
                    self._orphan(r, "the sender's failed write may still land", fenced=True)
                    return
                if isinstance(event, (AbortAck, _PeerGone, Abort)) or (
                    isinstance(event, Status) and event.state in ("SUCCESS", "FAILED", "ABORTED")
                ):
                    if isinstance(event, Abort):
                        self._send(AbortAck(room=room))
                    self._free(r)
                    return
        # No acknowledgement: the sender may still write. Keep the blocks fenced until it answers
        # late or is declared dead; never hand them to another room before that.
        self._orphan(r, f"no ABORT_ACK within {wait} s", fenced=True, level=logging.ERROR)

    # -- introspection -------------------------------------------------------------------

    @property
    def rooms_in_flight(self) -> int:
        """Rooms started and not yet ended."""
        return len(self._rooms)

