"""The encoder side: answers receivers' reservations by writing rows, round after round.

The sender does not stage rows into a pool of its own: it registers the caller's tensors with
the transport for the duration of ``send`` and writes straight from them. That saves a full
copy of every request (the copies, not the network, dominate on fast links) at the price of
one registration per request, which is cheap on TCP and amortised by large requests on RDMA.
The tensors must not be modified until ``send`` returns.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
import msgpack
import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from aioembed.config import TransferConfig
from aioembed.control.channel import ControlSocket
from aioembed.control.sockets import make_router
from aioembed.errors import (
    AioembedError,
    InvalidRequest,
    PeerDead,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferFailed,
    TransferTimeout,
    TransportError,
)
from aioembed.layout import Layout
from aioembed.memory.plan import FieldSpan, plan_row_runs, plan_writes
from aioembed.metrics import TransferObserver, outcome_of
from aioembed.protocol.messages import (
    PROTOCOL_VERSION,
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
from aioembed.protocol.room import RankPhase, SenderRoom, TransferStatus, WriteTask
from aioembed.session.backend import check_backend
from aioembed.transports.base import Link, MemoryRegion, Transport
from aioembed.transports.registry import open_transport

__all__ = ["EmbeddingSender"]

log = logging.getLogger(__name__)

_TOMBSTONES = 4096


@dataclass(eq=False)
class _Peer:
    """A receiver process that completed the handshake."""

    identity: bytes
    peer_id: str
    rank: int
    world: int
    num_blocks: int
    regions: tuple[tuple[int, int], ...]
    link: Link
    last_heard: float
    rooms: set[RoomId] = field(default_factory=set)
    alive: bool = True

    def __str__(self) -> str:
        return f"receiver rank {self.rank} ({self.peer_id[:8]})"


class _OutRoom:
    """Sender-side bookkeeping of one room."""

    def __init__(self, room: RoomId, block_size: int, now: float) -> None:
        self.machine = SenderRoom(room, block_size=block_size)
        self.rank_peer: dict[int, _Peer] = {}
        self.wake = anyio.Event()
        self.active = False
        self.sources: list[torch.Tensor] = []
        self.metadata: dict[str, Any] | None = None
        self.created = now
        self.status_sent_at: dict[int, float] = {}
        self.abort_from: set[int] = set()
        self.poisoned: set[int] = set()  # ranks a failed write may still reach (transport not cancel-safe)
        self.finished: set[int] = set()  # ranks already told that the room is over

    @property
    def room(self) -> RoomId:
        return self.machine.room

    def poke(self) -> None:
        self.wake.set()


class EmbeddingSender:
    """Serves rooms to any number of :class:`~aioembed.EmbeddingReceiver` ranks.

    Binds a ZeroMQ ROUTER at ``bind`` (``tcp://127.0.0.1:0`` picks a free port; read the
    concrete one from :attr:`address`).
    """

    def __init__(self, layout: Layout, config: TransferConfig | None = None, *, bind: str = "tcp://127.0.0.1:0",
                 observer: TransferObserver | None = None) -> None:
        self.layout = layout
        self.observer = observer or TransferObserver()
        self.config = config or TransferConfig()
        self.bind = bind
        self.peer_id = uuid.uuid4().hex
        self.address = ""
        self._peers: dict[bytes, _Peer] = {}
        self._rooms: dict[RoomId, _OutRoom] = {}
        # Recently ended rooms, so the other side learns at once: (who ended it, why, when).
        self._ended: OrderedDict[RoomId, tuple[str, str, float]] = OrderedDict()
        self._transport: Transport | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._auth: ThreadAuthenticator | None = None
        self._chan: ControlSocket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._active_sends = 0
        self._idle = anyio.Event()
        self._idle.set()

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        cfg = self.config
        self._transport = await open_transport(cfg.transport, cfg.transport_options)
        try:
            check_backend(self._transport, torch.device("cpu"))
            self._ctx = zmq.Context()
            sock, self.address, self._auth = make_router(self._ctx, self.bind, cfg)
            self._chan = ControlSocket(sock, self._on_frames, name=f"sender@{self.address}")
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        except BaseException:
            await self._teardown()
            raise
        self._tg.start_soon(self._chan.run)
        self._tg.start_soon(self._liveness_loop)
        log.info("sender: listening on %s (transport %s)", self.address, cfg.transport)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Fail rooms in flight (telling their receivers), then close everything."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for r in list(self._rooms.values()):
                r.machine.fail("sender closing", aborted=True)
                r.poke()
                if not r.active:
                    self._notify_end(r)
            # let active send() calls notify their ranks; their callers see TransferAborted
            with anyio.move_on_after(self.config.handshake_timeout):
                await self._idle.wait()
                if self._chan is not None:
                    await self._chan.drain()  # the final STATUS / ABORT_ACK frames must leave
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            await self._teardown()

    async def _teardown(self) -> None:
        for p in list(self._peers.values()):
            await p.link.aclose()
        self._peers.clear()
        if self._chan is not None:
            self._chan.close(linger_ms=200)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
        if self._transport is not None:
            await self._transport.aclose()

    # -- public API ----------------------------------------------------------------------

    async def send(
        self, room: RoomId, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None = None
    ) -> None:
        """Deliver ``tensors`` (one per layout field, same token count) to every expected rank.

        Returns once every rank holds every token; raises a :class:`TransferError` otherwise.
        The tensors are read in place (not copied) and must stay unchanged until this returns.
        """
        if self._tg is None or self._closed:
            raise AioembedError("the sender is not running: use `async with EmbeddingSender(...)`")
        cfg = self.config
        try:
            validate_room("room", room)
        except ProtocolError as exc:
            raise InvalidRequest(str(exc)) from None
        num_tokens = self.layout.validate(tensors)
        if not 1 <= num_tokens <= cfg.max_request_tokens:
            raise InvalidRequest(f"room {room!r}: {num_tokens} tokens; allowed 1..{cfg.max_request_tokens} "
                                 "(max_request_tokens)")
        meta = dict(metadata or {})
        try:
            meta_bytes = len(msgpack.packb(meta, use_bin_type=True))
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequest(f"room {room!r}: metadata is not msgpack-serialisable: {exc}") from None
        if meta_bytes > cfg.max_metadata_bytes:
            raise InvalidRequest(f"room {room!r}: metadata is {meta_bytes} bytes encoded; "
                                 f"at most max_metadata_bytes={cfg.max_metadata_bytes}")
        tomb = self._tombstone(room)
        if tomb is not None and tomb[0] == "receiver":
            del self._ended[room]
            raise TransferAborted(f"room {room!r} was ended by the receiver before send(): {tomb[1]}", room=room)
        sources = []
        for name in self.layout:
            t = tensors[name]
            if t.device.type != "cpu" and not (self._transport and self._transport.capabilities.cuda):
                raise InvalidRequest(f"room {room!r}: field {name!r} is on {t.device}; transport "
                                     f"{cfg.transport!r} moves CPU memory only")
            sources.append(t.contiguous())
        r = self._rooms.get(room)
        if r is not None and r.active:
            raise InvalidRequest(f"room {room!r} is already being sent")
        now = anyio.current_time()
        if r is None:
            r = _OutRoom(room, cfg.block_size, now)
            self._rooms[room] = r
        r.active = True
        self._active_sends += 1
        self._idle = anyio.Event() if self._active_sends == 1 else self._idle
        r.created = now
        r.sources = sources
        r.metadata = meta
        regions = [MemoryRegion.of_tensor(t) for t in sources]
        assert self._transport is not None
        t_start = time.perf_counter()
        error: BaseException | None = None
        try:
            r.machine.on_input(num_tokens)
            with anyio.CancelScope(shield=True):  # a registration must never be lost to a cancel
                await self._transport.register(regions)
            try:
                await self._drive(r)
            finally:
                if r.poisoned and self._tg is not None:
                    # A failed write may still read the source: keep it registered and alive a while.
                    self._tg.start_soon(self._release_later, regions, r.sources, self.config.round_timeout)
                else:
                    with anyio.CancelScope(shield=True):
                        await self._transport.unregister(regions)
        except ProtocolError as exc:
            error = TransferFailed(str(exc), room=room)
            raise error from None
        except BaseException as exc:
            error = exc
            raise
        finally:
            rounds = max((p.round + 1 for p in r.machine.ranks.values()), default=0)
            ok = r.machine.state is TransferStatus.SUCCESS
            self.observer.room_finished(
                side="sender", outcome="success" if ok else outcome_of(error or TransferFailed("failed")),
                nbytes=num_tokens * self.layout.bytes_per_token * len(r.machine.ranks), rounds=rounds,
                seconds=time.perf_counter() - t_start)
            if not ok:
                # A rank that asks later learns at once that this room is over.
                self._remember_ended(room, "sender", r.machine.error or "send() did not complete")
            r.active = False
            self._active_sends -= 1
            if self._active_sends == 0:
                self._idle.set()
            r.sources = []
            self._drop_room(r)

    async def _release_later(self, regions: list[MemoryRegion], sources: list[torch.Tensor], delay: float) -> None:
        """Unregister ``regions`` after ``delay``; holding ``sources`` keeps their memory alive until then."""
        try:
            await anyio.sleep(delay)
        finally:
            with anyio.CancelScope(shield=True):
                if self._transport is not None:
                    await self._transport.unregister(regions)

    def abort(self, room: RoomId, reason: str = "aborted by the sender") -> None:
        """End ``room`` without sending it (e.g. the encoder failed on the request).

        Ranks that already asked for it are told at once (their ``receive()`` raises
        ``TransferAborted`` with ``reason``); ranks that ask later within ``input_timeout`` are
        told when they ask. A ``send()`` in progress for the room is aborted too.
        """
        try:
            validate_room("room", room)
        except ProtocolError as exc:
            raise InvalidRequest(str(exc)) from None
        r = self._rooms.get(room)
        if r is not None:
            r.machine.fail(reason, aborted=True)
            if r.active:
                r.poke()  # the driver tells the ranks once its writes are over
                return
            self._notify_end(r)
            self._drop_room(r)
        self._remember_ended(room, "sender", reason)

    def _drop_room(self, r: _OutRoom) -> None:
        """Forget ``r``: out of the room table and out of every peer's room set."""
        if self._rooms.get(r.room) is r:
            del self._rooms[r.room]
        for p in r.rank_peer.values():
            p.rooms.discard(r.room)

    # -- driving one room ----------------------------------------------------------------

    def _next_deadline(self, r: _OutRoom) -> tuple[float, str]:
        cfg = self.config
        m = r.machine
        best = (r.created + cfg.room_timeout, "room")
        if m.expected_ranks is None or len(m.ranks) < m.expected_ranks:
            best = min(best, (r.created + cfg.input_timeout, "init"))
        for rank, p in m.ranks.items():
            if p.phase is RankPhase.AWAITING_RESUME:
                best = min(best, (r.status_sent_at.get(rank, r.created) + cfg.round_timeout, "resume"))
        return best

    async def _drive(self, r: _OutRoom) -> None:
        m = r.machine
        room = r.room
        error: TransferError | None = None
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    for rank in m.ready_ranks():
                        tg.start_soon(self._write, r, m.start_write(rank))
                    if m.state.terminal:
                        break
                    deadline, phase = self._next_deadline(r)
                    with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                        await r.wake.wait()
                    r.wake = anyio.Event()
                    if not m.state.terminal and anyio.current_time() >= deadline:
                        waiting = {
                            "init": f"INIT from {m.expected_ranks or 'any'} rank(s), got {sorted(m.ranks)}",
                            "resume": "RESUME from a rank after a partial round",
                            "room": "the whole room",
                        }[phase]
                        error = TransferTimeout(f"room {room!r}: timed out in phase {phase!r} waiting for {waiting}",
                                                room=room, phase=phase)
                        m.fail(str(error))
                        break
        finally:
            # All writes of this room are over here (the task group has exited), so telling the
            # ranks that the room ended is safe: they may free their blocks at once.
            if not m.state.terminal:
                m.fail("send() was cancelled", aborted=True)
            self._notify_end(r)
        if m.state is TransferStatus.SUCCESS:
            log.debug("sender: room=%r: done, %d tokens to %d ranks", room, m.total, m.expected_ranks)
            return
        if error is not None:
            raise error
        reason = m.error or "failed"
        if m.state is TransferStatus.ABORTED:
            raise TransferAborted(f"room {room!r}: aborted: {reason}", room=room)
        if any(not p.alive for p in r.rank_peer.values()):
            raise PeerDead(f"room {room!r}: {reason}", room=room)
        raise TransferFailed(f"room {room!r}: {reason}", room=room)

    async def _write(self, r: _OutRoom, task: WriteTask) -> None:
        peer = r.rank_peer[task.rank]
        room = r.room
        runs = plan_row_runs(num_tokens=task.count, block_size=self.config.block_size,
                             dst_blocks=task.blocks, src_start=task.start)
        spans = [
            FieldSpan(src_base=t.data_ptr(), dst_base=reg[0], row_bytes=f.row_bytes)
            for t, reg, f in zip(r.sources, peer.regions, self.layout.values(), strict=True)
        ]
        ops = plan_writes(runs, spans)
        t0 = time.perf_counter()
        try:
            await peer.link.write(ops)
            self.observer.round_finished(side="sender", seconds=time.perf_counter() - t0)
        except TransportError as exc:
            log.warning("sender: room=%r: write of %d tokens to %s failed: %s", room, task.count, peer, exc)
            assert self._transport is not None
            if not self._transport.capabilities.cancel_safe_writes:
                r.poisoned.add(task.rank)
            r.machine.fail(f"write of {task.count} tokens ({sum(o.length for o in ops)} bytes) to {peer} "
                           f"failed: {exc}")
            r.poke()
            return
        if r.machine.failed is not None:
            r.poke()
            return
        status = r.machine.write_done(task, metadata=r.metadata)
        self._send_to(peer, status)
        if status.state == "SUCCESS":
            r.finished.add(task.rank)
        r.status_sent_at[task.rank] = anyio.current_time()
        log.debug("sender: room=%r: round %d to rank %d: %d tokens (%d ops)", room, task.round, task.rank,
                  task.count, len(ops))
        r.poke()

    def _notify_end(self, r: _OutRoom) -> None:
        """Tell every rank that still holds a reservation that the room is over."""
        m = r.machine
        for rank, peer in r.rank_peer.items():
            if rank in r.finished or not peer.alive:
                continue
            r.finished.add(rank)
            poisoned = rank in r.poisoned  # then no ABORT_ACK: we cannot promise nothing lands any more
            if rank in r.abort_from and not poisoned:
                self._send_to(peer, AbortAck(room=r.room))
            elif m.state is not TransferStatus.SUCCESS:
                aborted = m.state is TransferStatus.ABORTED and not poisoned
                self._send_to(peer, Status(room=r.room, state="ABORTED" if aborted else "FAILED",
                                           total_tokens=m.total or 0, sent_tokens=0, round=0,
                                           error=(m.error or "failed")[:4000], fence=poisoned))

    # -- control messages ----------------------------------------------------------------

    def _send_to(self, peer: _Peer, msg: Message) -> None:
        self._send_identity(peer.identity, msg)

    def _send_identity(self, identity: bytes, msg: Message) -> None:
        assert self._chan is not None
        try:
            self._chan.send([identity, encode(msg)])
        except AioembedError as exc:
            log.error("sender: cannot queue %s to %r: %s", msg.TYPE, identity, exc)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("sender: dropped a %d-frame message", len(frames))
            return
        identity, payload = frames
        try:
            msg = decode(payload)
        except ProtocolError as exc:
            log.warning("sender: bad frame from %r (room=%s): %s", identity, exc.room, exc)
            self._send_identity(identity, Reject(reason=f"bad frame: {exc}"[:4000], room=exc.room,
                                                       code="bad_frame"))
            return
        peer = self._peers.get(identity)
        if peer is not None:
            peer.last_heard = anyio.current_time()
        if isinstance(msg, Hello):
            assert self._tg is not None
            self._tg.start_soon(self._handshake, identity, msg)
            return
        if isinstance(msg, Ping):
            self._send_identity(identity, Pong(nonce=msg.nonce, peer_id=self.peer_id))
            return
        if peer is None:
            room = getattr(msg, "room", None)
            if isinstance(msg, Abort):
                self._send_identity(identity, AbortAck(room=msg.room))
            elif not isinstance(msg, (Pong, AbortAck, Reject)):
                self._send_identity(identity, Reject(reason="unknown peer: send HELLO first", room=room,
                                                           code="unknown_peer"))
            return
        try:
            if isinstance(msg, Init):
                self._on_init(peer, msg)
            elif isinstance(msg, Resume):
                self._on_resume(peer, msg)
            elif isinstance(msg, Abort):
                self._on_abort(peer, msg)
            elif isinstance(msg, Reject):
                self._on_reject(peer, msg)
            elif isinstance(msg, (Pong, AbortAck)):
                pass
            else:
                log.warning("sender: unexpected %s from %s, ignored", msg.TYPE, peer)
        except ProtocolError as exc:
            log.warning("sender: room=%s: %s from %s refused: %s", exc.room, msg.TYPE, peer, exc)
            self._send_to(peer, Reject(reason=str(exc)[:4000], room=exc.room))

    async def _handshake(self, identity: bytes, hello: Hello) -> None:
        cfg = self.config
        problems = []
        if hello.fingerprint != self.layout.fingerprint:
            problems.append(f"layout fingerprint {hello.fingerprint} != sender's {self.layout.fingerprint} "
                            f"(sender layout {self.layout!r})")
        if hello.block_size != cfg.block_size:
            problems.append(f"block_size {hello.block_size} != sender's {cfg.block_size}")
        if hello.transport != cfg.transport:
            problems.append(f"transport {hello.transport!r} != sender's {cfg.transport!r}")
        if len(hello.regions) != len(self.layout):
            problems.append(f"{len(hello.regions)} pool regions for {len(self.layout)} layout fields")
        else:
            rows = hello.num_blocks * hello.block_size
            for (name, f), (_, length) in zip(self.layout.items(), hello.regions, strict=True):
                if length != rows * f.row_bytes:
                    problems.append(f"pool region of field {name!r} is {length} bytes, expected {rows * f.row_bytes}")
        if problems:
            reason = f"incompatible receiver (protocol v{PROTOCOL_VERSION}): " + "; ".join(problems)
            log.warning("sender: refused rank %d: %s", hello.rank, reason)
            self._send_identity(identity, Reject(reason=reason[:4000], code="incompatible"))
            return
        assert self._transport is not None
        try:
            with anyio.fail_after(cfg.handshake_timeout):
                link = await self._transport.connect(hello.descriptor)
        except (TransportError, TimeoutError) as exc:
            reason = f"cannot connect transport {cfg.transport!r} to receiver rank {hello.rank}: {exc!r}"
            log.warning("sender: %s", reason)
            self._send_identity(identity, Reject(reason=reason[:4000], code="incompatible"))
            return
        old = self._peers.get(identity)
        if old is not None and old.peer_id == hello.peer_id:
            await link.aclose()  # a repeated HELLO of the same session: answer again, keep its rooms
            self._send_identity(identity, Welcome(peer_id=self.peer_id, heartbeat_interval=cfg.heartbeat_interval))
            return
        if old is not None:
            self._peer_lost(old, "receiver said HELLO again (it restarted its session)")
        peer = _Peer(identity=identity, peer_id=hello.peer_id, rank=hello.rank, world=hello.world,
                     num_blocks=hello.num_blocks, regions=hello.regions, link=link,
                     last_heard=anyio.current_time())
        self._peers[identity] = peer
        self._send_identity(identity, Welcome(peer_id=self.peer_id, heartbeat_interval=cfg.heartbeat_interval))
        log.info("sender: %s connected (world %d)", peer, hello.world)

    def _on_init(self, peer: _Peer, msg: Init) -> None:
        room = msg.room
        tomb = self._tombstone(room) if room not in self._rooms else None
        if tomb is not None and tomb[0] == "sender":
            self._send_to(peer, Status(room=room, state="ABORTED", total_tokens=0, sent_tokens=0, round=0,
                                       error=f"the sender ended this room before rank {peer.rank} asked: "
                                             f"{tomb[1]}"[:4000]))
            return
        if msg.expected_ranks != peer.world:
            raise ProtocolError(f"INIT expects {msg.expected_ranks} ranks but {peer} declared world {peer.world}",
                                room=room)
        r = self._rooms.get(room)
        new = r is None
        if r is None:
            if len(peer.rooms) >= self.config.max_rooms_per_peer:
                raise ProtocolError(f"{peer} has {len(peer.rooms)} rooms open; max_rooms_per_peer="
                                    f"{self.config.max_rooms_per_peer}", room=room)
            r = _OutRoom(room, self.config.block_size, anyio.current_time())
        r.machine.on_init(peer.rank, blocks=msg.blocks, allocated_tokens=msg.allocated_tokens,
                          expected_ranks=msg.expected_ranks, num_blocks=peer.num_blocks)
        if new:  # only a valid INIT creates a room: refused frames leave nothing behind
            self._rooms[room] = r
        r.rank_peer[peer.rank] = peer
        peer.rooms.add(room)
        self._ended.pop(room, None)
        r.poke()

    def _on_resume(self, peer: _Peer, msg: Resume) -> None:
        r = self._rooms.get(msg.room)
        if r is None or r.rank_peer.get(peer.rank) is not peer:
            raise ProtocolError(f"RESUME for room {msg.room!r}, which {peer} has not started", room=msg.room)
        r.machine.on_resume(peer.rank, round=msg.round, sent_tokens=msg.sent_tokens, blocks=msg.blocks,
                            allocated_tokens=msg.allocated_tokens, num_blocks=peer.num_blocks)
        r.poke()

    def _on_abort(self, peer: _Peer, msg: Abort) -> None:
        r = self._rooms.get(msg.room)
        if r is None or r.rank_peer.get(peer.rank) is not peer:
            self._send_to(peer, AbortAck(room=msg.room))
            return
        log.info("sender: room=%r: aborted by %s: %s", msg.room, peer, msg.reason)
        r.abort_from.add(peer.rank)
        r.machine.fail(f"aborted by {peer}: {msg.reason}", aborted=True)
        if r.active:
            r.poke()  # the driver acknowledges once this room's writes are over
        else:
            self._notify_end(r)  # nothing was written: acknowledge at once
            self._drop_room(r)
            self._remember_ended(msg.room, "receiver", msg.reason)

    def _on_reject(self, peer: _Peer, msg: Reject) -> None:
        log.warning("sender: %s rejected a frame (room=%r): %s", peer, msg.room, msg.reason)
        if msg.room is not None and (r := self._rooms.get(msg.room)) is not None:
            r.machine.fail(f"{peer} rejected: {msg.reason}")
            r.poke()

    def _remember_ended(self, room: RoomId, by: str, reason: str) -> None:
        self._ended[room] = (by, reason, anyio.current_time())
        self._ended.move_to_end(room)
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)

    def _tombstone(self, room: RoomId) -> tuple[str, str, float] | None:
        """A room ended within the last ``input_timeout`` (older ones may be a new request)."""
        tomb = self._ended.get(room)
        if tomb is not None and anyio.current_time() - tomb[2] > self.config.input_timeout:
            del self._ended[room]
            return None
        return tomb

    # -- liveness ------------------------------------------------------------------------

    async def _liveness_loop(self) -> None:
        cfg = self.config
        limit = cfg.heartbeat_interval * cfg.heartbeat_misses
        last_tick = anyio.current_time()
        while True:
            await anyio.sleep(cfg.heartbeat_interval)
            now = anyio.current_time()
            if now - last_tick > 2 * cfg.heartbeat_interval:
                # Our own loop was starved: do not blame peers for silence we could not hear.
                for peer in self._peers.values():
                    peer.last_heard = max(peer.last_heard, now - cfg.heartbeat_interval)
            last_tick = now
            for peer in list(self._peers.values()):
                if now - peer.last_heard > limit:
                    self._peer_lost(peer, f"{peer} silent for more than {limit:.1f} s")

    def _peer_lost(self, peer: _Peer, reason: str) -> None:
        log.warning("sender: %s; failing its %d rooms", reason, len(peer.rooms))
        peer.alive = False
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]
        for room in list(peer.rooms):
            r = self._rooms.get(room)
            if r is None:
                continue
            r.machine.fail(reason)
            r.poke()
            if not r.active:
                self._notify_end(r)
                self._drop_room(r)
        peer.rooms.clear()
        if self._tg is not None:
            self._tg.start_soon(peer.link.aclose)

    # -- introspection -------------------------------------------------------------------

    @property
    def peers(self) -> list[str]:
        """Connected receivers, for logs and tests."""
        return [str(p) for p in self._peers.values()]

    @property
    def rooms_in_flight(self) -> int:
        """Rooms known to the sender (sending, or reserved by a receiver and awaiting ``send``)."""
        return len(self._rooms)
