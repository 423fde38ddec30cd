"""The language side's public face: ``EmbeddingReceiver``.

It owns the registered pool (allocator + ownership ledger, through the block keeper), one
control connection per sender address, and one task per room. The work lives in
:mod:`~aioembed.session.receive_room` (one room), :mod:`~aioembed.session.connection` (one
sender) and :mod:`~aioembed.session.block_keeper` (the pool); this module wires them up and owns
their lifecycle.

Lifecycle: background tasks run in a task group entered by ``__aenter__``, each inside its own
cancel scope, so :meth:`EmbeddingReceiver.aclose` works from any task (a server's shutdown hook)
without cancelling the task that entered ``async with``, and returns within about
:data:`CLOSE_GRACE` seconds whatever the peers do.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Literal, Self, TypeVar, overload

import anyio
import anyio.abc
import torch
import zmq
from anyio.streams.memory import MemoryObjectSendStream

from aioembed.config import TransferConfig
from aioembed.errors import AioembedError, InvalidRequest, ProtocolError, room_prefix
from aioembed.layout import Layout
from aioembed.memory.allocator import BlockAllocator
from aioembed.memory.output_cache import OutputCache
from aioembed.memory.pool import BlockPool
from aioembed.metrics import TransferObserver
from aioembed.protocol.messages import RoomId, TransferStatus, validate_room
from aioembed.protocol.ownership import FenceReason
from aioembed.session.assembly import Part, RoomAssembly, check_parts, part_output
from aioembed.session.async_library import KnownAsyncLibrary
from aioembed.session.backend import check_backend
from aioembed.session.block_keeper import BlockKeeper
from aioembed.session.connection import LossKind, SenderConnection
from aioembed.session.copy_out import RoundCopier
from aioembed.session.deadlines import timeout_seconds
from aioembed.session.guarded_observer import GuardedObserver
from aioembed.session.handle import Received, ReceiveHandle
from aioembed.session.lease import Lease, LeaseReturns
from aioembed.session.receive_room import ReceiveRoomDriver, RoomContext, fresh_output, short_fields
from aioembed.session.room_deadlines import RoomDeadlines
from aioembed.session.run_once import RunOnce
from aioembed.session.stream import Chunk, LeasedChunk, RoomStream, StreamItem
from aioembed.session.tasks import BackgroundTasks
from aioembed.transports.base import Transport
from aioembed.transports.boundary import GuardedTransport, guard
from aioembed.transports.registry import open_configured

__all__ = ["CLOSE_GRACE", "EmbeddingReceiver", "Part"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

CLOSE_GRACE = 2.0
"""Seconds ``aclose()`` gives rooms to end and their ABORT frames to leave before closing hard."""

class EmbeddingReceiver:
    """Receives rooms into one registered pool, as rank ``rank`` of ``world``.

    ``connect`` names the default sender; ``receive(room, sender=address)`` names one per room.
    Use as an async context manager; ``receive(room)`` returns the complete request.
    ``transport`` injects an endpoint instead of opening ``config.transport`` (the receiver
    closes it); the session reaches it only through the plugin boundary.
    """

    def __init__(
        self,
        layout: Layout,
        config: TransferConfig | None = None,
        *,
        connect: str | None = None,
        rank: int = 0,
        world: int = 1,
        observer: TransferObserver | None = None,
        transport: Transport | None = None,
    ) -> None:
        self.layout = layout
        # The caller's hooks cannot break a room: what they raise is logged and dropped.
        self.observer: TransferObserver = GuardedObserver(observer) if observer is not None else TransferObserver()
        self.config = config or TransferConfig()
        if not isinstance(world, int) or not 1 <= world <= 1 << 16:
            raise InvalidRequest(f"world={world!r} must be an int in [1, 65536]")
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise InvalidRequest(f"rank={rank!r} must be an int in [0, world={world})")
        if connect is not None and (not isinstance(connect, str) or not connect):
            raise InvalidRequest(f"connect={connect!r} must be a ZeroMQ address such as 'tcp://host:port'")
        self.connect_to = connect
        self.rank = rank
        self.world = world
        self.receiver_id = uuid.uuid4().hex
        cfg = self.config
        self.pool = BlockPool(layout, num_blocks=cfg.pool_blocks, block_size=cfg.block_size, device=cfg.device)
        self._field_names = frozenset(layout)
        self._pool_spans = tuple((r.device, r.address, r.end, f"the receiver's pool ({name!r})")
                                 for name, r in zip(layout, self.pool.regions(), strict=True))
        """What an ``out=`` may not overlap (checked on every request that passes one; the pool never moves)."""
        self.allocator = BlockAllocator(num_blocks=cfg.pool_blocks, block_size=cfg.block_size)
        self.keeper = BlockKeeper(self.allocator, name=f"receiver[{rank}]", observer=self.observer,
                                  stall_tolerance=min(0.5, cfg.heartbeat_interval / 2),
                                  watch_every=cfg.heartbeat_interval)
        self.outputs = OutputCache(cfg.output_cache_bytes)
        """Makes ``receive()``'s fresh outputs, from the memory of dropped ones (``outputs.stats``)."""
        self._given_transport = transport
        self._transport: GuardedTransport | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._conns: dict[str, SenderConnection] = {}
        self._epochs = itertools.count(1)  # handshake epochs, growing across connections (see SenderConnection)
        self._rooms: dict[RoomId, ReceiveRoomDriver | RoomAssembly] = {}
        self._room_ctx: RoomContext | None = None
        self._deadlines = RoomDeadlines()
        self._tasks = BackgroundTasks(f"receiver[{rank}]", log)
        self._spawn = self._tasks.spawn
        self._closing = False
        self._closed = anyio.Event()
        self._run_once = RunOnce("receiver")

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._run_once.enter(closing=self._closing)
        cfg = self.config
        if self._given_transport is not None:
            self._transport = guard(self._given_transport)
        else:
            self._transport = await open_configured(cfg)
        try:
            check_backend(self._transport, self.pool.device)
            await self._transport.register(self.pool.regions())
            self._ctx = zmq.Context()
            returns = LeaseReturns(self._give_back_grants, self._spawn)
            self._room_ctx = RoomContext(
                keeper=self.keeper, pool=self.pool, layout=self.layout, config=cfg, observer=self.observer,
                copier=RoundCopier(self.pool, threads=cfg.copy_threads), returns=returns, outputs=self.outputs,
                deadlines=self._deadlines, rank=self.rank, forget=self._forget, unstarted=self._unstarted_reservations)
            await self._tasks.enter()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._teardown()
            raise
        self._spawn(self.keeper.run_timers)
        self._spawn(self._deadlines.run)
        if self.connect_to is not None:
            self._connection(self.connect_to)
        self._run_once.started()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._close()

    async def aclose(self) -> None:
        """Abort rooms in flight, close every connection and the transport. Safe from any task,
        bounded (about ``CLOSE_GRACE`` seconds), idempotent."""
        await self._close()

    async def _close(self) -> None:
        if self._closing:
            with anyio.CancelScope(shield=True):
                await self._closed.wait()
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            try:
                with anyio.move_on_after(CLOSE_GRACE):
                    for r in list(self._rooms.values()):
                        r.handle.cancel("receiver closing")
                    for r in list(self._rooms.values()):
                        await r.handle.wait()
                    for c in list(self._conns.values()):  # one may leave the table meanwhile
                        await c.chan.drain()  # the ABORT frames must leave
                self._tasks.cancel_all()
                await self._tasks.wait_done(CLOSE_GRACE)
                if self._room_ctx is not None:
                    self._room_ctx.returns.close()  # releases queued off the loop, or waiting for a fence
                await self._teardown()
            finally:
                self._closed.set()

    async def _teardown(self) -> None:
        try:
            await self._tasks.exit()  # its tasks were cancelled (or never started): the host stops
        finally:
            self.keeper.close()
            self.outputs.close()
        for c in self._conns.values():
            c.close()
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            # Every socket is closed by now; destroy() makes sure a stray one cannot block term().
            await anyio.to_thread.run_sync(ctx.destroy, 0)
        if self._transport is not None:
            await self._transport.aclose()

    # -- connections -------------------------------------------------------------------------

    def _connection(self, address: str) -> SenderConnection:
        conn = self._conns.get(address)
        if conn is not None:
            conn.touch()
            return conn
        assert self._ctx is not None and self._transport is not None and self._room_ctx is not None
        if len(self._conns) >= self.config.max_senders:
            self._close_an_idle_connection()
        conn = SenderConnection(
            address, ctx=self._ctx, config=self.config, layout=self.layout, pool=self.pool, rank=self.rank,
            world=self.world, receiver_id=self.receiver_id, keeper=self.keeper, transport=self._transport,
            returns=self._room_ctx.returns, spawn=self._spawn, next_epoch=functools.partial(next, self._epochs),
            twin_of=self._twin_of)
        self._conns[address] = conn
        self._spawn(self._run_connection, conn)
        return conn

    def _twin_of(self, conn: SenderConnection, sender_id: str) -> SenderConnection | None:
        """Another connection holding a live session with the sender ``sender_id`` (it is reached under two
        addresses). Only a live one: a connection keeps the id of a sender that has gone (restarted elsewhere)."""
        return next((c for c in self._conns.values()
                     if c is not conn and c.ready and c.sender_id == sender_id), None)

    async def _run_connection(self, conn: SenderConnection) -> None:
        """One sender's tasks, under one scope: stopped together when the connection is closed."""
        try:
            with conn.stop_scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(conn.chan.run)
                    tg.start_soon(conn.monitor.run)
                    tg.start_soon(conn.run)
                    tg.start_soon(self._close_when_idle, conn)
        finally:
            if self._conns.get(conn.address) is conn:
                del self._conns[conn.address]
            conn.close()  # its socket tasks have ended
            if conn.address not in self._conns:  # no newer connection to that sender shares its series
                self.observer.sender_closed(sender=conn.address)

    def _idle(self, conn: SenderConnection) -> bool:
        """No room uses ``conn``, nobody awaits its handshake (``wait_connected()``: closed under it, that call failed
        with "the connection ... was closed") and no block its sender may still write is held: it can go.
        Readable grants (a lease, chunks a stream's caller holds) do not count: their writer said its writes
        ended, so no write reaches them and nothing about them needs the connection; counted, a lease held
        for long kept the connection busy, and a room from another sender was refused under ``max_senders``."""
        return (not conn.rooms and not conn.waiters
                and not (conn.sender_id and self.keeper.ledger.reachable_by(conn.sender_id)))

    async def _close_when_idle(self, conn: SenderConnection) -> None:
        """Close ``conn`` once no room started on it for ``sender_idle_timeout`` (and it holds nothing):
        wakes once per timeout at most, and rooms starting cost nothing here."""
        timeout = self.config.sender_idle_timeout
        conn.touch()
        while True:
            await anyio.sleep(max(0.0, conn.last_used + timeout - anyio.current_time()))
            if anyio.current_time() < conn.last_used + timeout:
                continue  # a room started meanwhile
            if self._idle(conn):
                log.info("receiver[%d]: closing the idle connection to sender %s", self.rank, conn.address)
                # Out of the table first: a room starting before the connection's tasks have ended gets a new
                # connection, not this one (it would announce blocks on a socket about to close).
                if self._conns.get(conn.address) is conn:
                    del self._conns[conn.address]
                conn.stop_scope.cancel()
                return
            conn.touch()  # busy (rooms, or blocks its sender may still write): look again later

    def _close_an_idle_connection(self) -> None:
        idle = [c for c in self._conns.values() if self._idle(c)]
        if not idle:
            raise InvalidRequest(f"this receiver already has {len(self._conns)} senders with rooms, fenced blocks or "
                                 "a wait_connected() in progress "
                                 f"(max_senders={self.config.max_senders})")
        oldest = min(idle, key=lambda c: c.last_used)
        log.info("receiver[%d]: closing the connection to sender %s to make room (max_senders=%d)", self.rank,
                 oldest.address, self.config.max_senders)
        del self._conns[oldest.address]
        oldest.stop_scope.cancel()

    def _sender_address(self, sender: str | None) -> str:
        address = sender if sender is not None else self.connect_to
        if address is None:
            raise InvalidRequest("no sender named: pass receive(room, sender='tcp://host:port') or "
                                 "EmbeddingReceiver(..., connect=...)")
        if not isinstance(address, str) or not address:
            raise InvalidRequest(f"sender={address!r} must be a ZeroMQ address such as 'tcp://host:port'")
        return address

    @property
    def connected(self) -> bool:
        """True while a handshake with the default sender holds."""
        return self.connected_to(self.connect_to) if self.connect_to is not None else False

    def connected_to(self, sender: str) -> bool:
        """True while a handshake with the sender at ``sender`` holds (never connects; see :meth:`wait_connected`)."""
        conn = self._conns.get(sender)
        return conn is not None and conn.ready

    async def wait_connected(self, timeout: float | None = None, *, sender: str | None = None) -> None:
        """Wait for a handshake with ``sender`` (default: ``connect``; deadline: ``handshake_timeout``). Meanwhile its
        connection is in use: it is not closed to make room under ``max_senders``, nor as idle."""
        self._check_running()
        seconds = timeout_seconds("timeout", timeout, self.config.handshake_timeout)
        conn = self._connection(self._sender_address(sender))
        conn.waiters += 1
        try:
            await conn.wait_ready(seconds)
        finally:
            conn.waiters -= 1
            conn.touch()  # idle from now on (if no room came): its idle timeout counts from here

    def _check_running(self, room: int | str | None = None) -> None:
        """Refuse a call once the receiver is closing; ``room``: the room asked for (named in the error)."""
        if self._closing:
            raise AioembedError(f"{room_prefix(room)}the receiver is closing or closed "
                                "(its `async with` block ended, or aclose() was called): it takes no new rooms")
        if not self._tasks.entered:
            raise AioembedError("the receiver is not running: use `async with EmbeddingReceiver(...)`")
        self._run_once.check_thread()

    # -- public API --------------------------------------------------------------------------

    def start(self, room: int | str, *, expected_tokens: int | None = None, zero_copy: bool = False,
              out: Mapping[str, torch.Tensor] | None = None, sender: str | None = None,
              parts: Sequence[Part] | None = None, stream: bool = False,
              chunk_tokens: int | None = None) -> ReceiveHandle:
        """Begin receiving ``room``; returns at once with a handle.

        With ``zero_copy`` the result is a :class:`Lease` on pool blocks (``handle.lease()``)
        instead of freshly allocated tensors (``handle.result()``). With ``out``, rows are copied
        into the caller's tensors (one per field, enough rows, contiguous; reusing buffers saves
        the page faults of fresh allocations) and ``result().tensors`` are views of them.
        ``sender`` names the sender's address for this room (default: ``connect``). ``parts``
        assembles the room from parts sent by several senders (see :class:`Part`). ``stream``:
        rows are handed out as they land, through ``handle.stream()`` (see :meth:`stream`).
        """
        handle, driver = self._open_room(room, expected_tokens=expected_tokens, zero_copy=zero_copy, out=out,
                                         sender=sender, parts=parts, stream=stream, chunk_tokens=chunk_tokens)
        if driver is not None:
            self._spawn(driver.run)
        return handle

    def _open_room(self, room: int | str, *, expected_tokens: int | None = None, zero_copy: bool = False,
                   out: Mapping[str, torch.Tensor] | None = None, sender: str | None = None,
                   parts: Sequence[Part] | None = None, stream: bool = False,
                   chunk_tokens: int | None = None) -> tuple[ReceiveHandle, ReceiveRoomDriver | None]:
        """Check the request and set the room up; returns its handle and the driver to run (``None``: the
        room runs by itself, e.g. one assembled from parts)."""
        self._check_out(out, zero_copy)
        self._check_running(room)
        if isinstance(room, (tuple, list)):
            raise InvalidRequest(f"room={room!r}: a room id is an int or a str")
        try:
            validate_room("room", room)
        except ProtocolError as exc:
            raise InvalidRequest(str(exc)) from None
        if room in self._rooms:
            raise InvalidRequest(f"room {room!r} is already being received")
        handle = ReceiveHandle(room)
        handle._scope = anyio.CancelScope()
        if parts is not None:
            if stream:
                raise InvalidRequest(f"room {room!r}: a room assembled from parts cannot be streamed yet; receive "
                                     "it whole, or stream each sender's rooms on their own")
            if sender is not None or expected_tokens is not None:
                raise InvalidRequest("with parts=, each Part names its sender and its tokens: drop sender= and "
                                     "expected_tokens=")
            parts = check_parts(room, parts, self.config.max_request_tokens)
            total = parts[-1].end
            output = None if zero_copy else self._output_for(room, total, out)
            drivers = self._part_drivers(room, parts, zero_copy=zero_copy, output=output)
            for d in drivers:
                self._spawn(d.run)
            asm = RoomAssembly(room, handle, parts, [d.handle for d in drivers], zero_copy=zero_copy, output=output)
            self._rooms[room] = asm
            self._spawn(self._run_assembly, asm)
            return handle, None
        cfg = self.config
        if expected_tokens is not None and (
            not isinstance(expected_tokens, int) or not 1 <= expected_tokens <= cfg.max_request_tokens
        ):
            raise InvalidRequest(f"expected_tokens={expected_tokens!r} must be in "
                                 f"[1, max_request_tokens={cfg.max_request_tokens}]")
        sink: MemoryObjectSendStream[StreamItem] | None = None
        progress = 0
        if stream:
            progress = self._progress_tokens(chunk_tokens)
            sink, chunks = anyio.create_memory_object_stream[StreamItem](math.inf)  # bounded by the room's length
            handle._stream = RoomStream(handle, chunks)
        elif chunk_tokens is not None:
            raise InvalidRequest("chunk_tokens= is for streamed rooms (stream=True)")
        try:
            driver = self._new_driver(room, self._sender_address(sender), expected_tokens=expected_tokens,
                                      exact=False, zero_copy=zero_copy, out=out, handle=handle, stream=sink,
                                      progress_tokens=progress)
        except BaseException:
            # Refused (no sender named, the id's earlier attempt not settled, no connection free): the chunk
            # stream was made for a room that never starts. Left open, anyio warns of both ends when collected.
            if sink is not None:
                sink.close()
                chunks.close()
            raise
        return handle, driver

    @overload
    def stream(self, room: int | str, *, expected_tokens: int | None = ..., zero_copy: Literal[False] = ...,
               out: Mapping[str, torch.Tensor] | None = ..., sender: str | None = ...,
               chunk_tokens: int | None = ...) -> RoomStream[Chunk]: ...

    @overload
    def stream(self, room: int | str, *, expected_tokens: int | None = ..., zero_copy: Literal[True],
               out: Mapping[str, torch.Tensor] | None = ..., sender: str | None = ...,
               chunk_tokens: int | None = ...) -> RoomStream[LeasedChunk]: ...

    @overload
    def stream(self, room: int | str, *, expected_tokens: int | None = ..., zero_copy: bool,
               out: Mapping[str, torch.Tensor] | None = ..., sender: str | None = ...,
               chunk_tokens: int | None = ...) -> RoomStream[StreamItem]: ...

    def stream(self, room: int | str, *, expected_tokens: int | None = None, zero_copy: bool = False,
               out: Mapping[str, torch.Tensor] | None = None, sender: str | None = None,
               chunk_tokens: int | None = None) -> RoomStream[Chunk] | RoomStream[LeasedChunk] | RoomStream[StreamItem]:
        """Receive ``room`` as chunks in token order, each as soon as its rows have landed::

            async with receiver.stream(room) as chunks:
                async for chunk in chunks:          # Chunk: chunk.start, chunk.end, chunk.tensors
                    prefill(chunk.tensors)

        ``zero_copy``: :class:`LeasedChunk` views of pool blocks, each released by the caller (``with
        chunk:``). ``chunk_tokens`` (default ``stream_chunk_tokens``, rounded up to whole blocks; 0: one
        chunk per round) bounds how often the sender announces rows within a round. Leaving the ``async
        with`` before the room completed aborts it and releases every leased chunk of it. See
        :mod:`aioembed.session.stream`.
        """
        handle = self.start(room, expected_tokens=expected_tokens, zero_copy=zero_copy, out=out, sender=sender,
                            stream=True, chunk_tokens=chunk_tokens)
        return handle.stream()

    def _progress_tokens(self, chunk_tokens: int | None) -> int:
        """``chunk_tokens`` (or the configured default) as whole blocks; 0 stays 0 (chunks per round)."""
        chunk = self.config.stream_chunk_tokens if chunk_tokens is None else chunk_tokens
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise InvalidRequest(f"chunk_tokens={chunk!r} must be an int >= 0 (0: one chunk per round)")
        return self._whole_blocks(chunk)

    def _copy_stays_on_gpu(self, out: Mapping[str, torch.Tensor] | None) -> bool:
        """True when a copying receive copies from a CUDA pool into CUDA memory (``out`` or a fresh output on
        the pool's device). Such a device copy is far faster than any write into the pool, so chunks would
        save less than each one's extra write and announcement costs (H200, NIXL: 100000 tokens 14.8-19.8 ms
        chunked, 6.5-7.0 ms in whole rounds); a copy to the CPU still overlaps the writes chunk by chunk."""
        if self.pool.device.type != "cuda":
            return False
        return out is None or all(t.device.type == "cuda" for t in out.values())

    def _whole_blocks(self, tokens: int) -> int:
        bs = self.config.block_size
        return -(-tokens // bs) * bs

    def _part_drivers(self, room: int | str, parts: Sequence[Part], *, zero_copy: bool,
                      output: dict[str, torch.Tensor] | None) -> list[ReceiveRoomDriver]:
        """The drivers of every part of ``room`` (wire id ``(room, i)``), set up and not run: all of them, or
        none, raising what stopped the first that could not be set up (no connection free under
        ``max_senders``, a part already being received, blocks of an earlier attempt still fenced)."""
        drivers: list[ReceiveRoomDriver] = []
        try:
            for i, p in enumerate(parts):
                drivers.append(self._new_driver((room, i), p.sender, expected_tokens=p.tokens, exact=True,
                                                zero_copy=zero_copy, out=part_output(output, p), handle=None))
        except BaseException:
            for d in drivers:
                d.abandon()
            raise
        return drivers

    def _new_driver(self, key: RoomId, address: str, *, expected_tokens: int | None, exact: bool,
                    zero_copy: bool, out: Mapping[str, torch.Tensor] | None,
                    handle: ReceiveHandle | None, stream: MemoryObjectSendStream[StreamItem] | None = None,
                    progress_tokens: int = 0) -> ReceiveRoomDriver:
        """The driver of one room, or of one part (``key`` = ``(room, part)``) of one: set up, not run."""
        conn = self._connection(address)
        if key in conn.rooms:
            raise InvalidRequest(f"room {key!r} is already being received from sender {address}")
        if conn.held_ids.owes_answer(key):
            raise InvalidRequest(f"room {key!r}: sender {address} has not yet acknowledged the abort of its earlier "
                                 "attempt (it may still be ending it); retry once it has, or use another room id")
        if conn.writer is not None and self.keeper.ledger.holds_room(conn.writer, key):
            raise InvalidRequest(f"room {key!r}: blocks of an earlier attempt are still fenced (a write of "
                                 f"sender {conn.address} may still reach them); use another room id")
        assert self._room_ctx is not None
        if handle is None:
            handle = ReceiveHandle(key)
            handle._scope = anyio.CancelScope()
        if stream is None and not zero_copy and not self._copy_stays_on_gpu(out):
            # Copied out chunk by chunk while the rest of the round is written (the copy overlaps the transfer).
            progress_tokens = self._whole_blocks(self.config.copy_chunk_tokens)
        r = ReceiveRoomDriver(key, handle, conn, self._room_ctx, expected_tokens=expected_tokens,
                              zero_copy=zero_copy, out=out, exact_tokens=exact, stream=stream,
                              progress_tokens=progress_tokens,
                              caller_stream=(torch.cuda.current_stream(self.pool.device)
                                             if self.pool.device.type == "cuda" else None))
        if not isinstance(key, tuple):
            self._rooms[key] = r
        conn.rooms[key] = r
        return r

    async def _run_assembly(self, asm: RoomAssembly) -> None:
        try:
            await asm.run()
        finally:
            if self._rooms.get(asm.room) is asm:
                del self._rooms[asm.room]

    def _output_for(self, room: RoomId, total: int, out: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The room's output: the caller's tensors (checked) or fresh ones, for ``total`` tokens."""
        if out is None:
            return fresh_output(self.outputs, self.layout, total, self.pool.device, room)
        short = short_fields(out, total)
        if short:
            raise InvalidRequest(f"room {room!r}: its parts hold {total} tokens but out= holds only {short}")
        return {n: t[:total] for n, t in out.items()}

    async def receive(self, room: int | str, *, expected_tokens: int | None = None,
                      out: Mapping[str, torch.Tensor] | None = None, sender: str | None = None,
                      parts: Sequence[Part] | None = None) -> Received:
        """Receive ``room`` completely. Cancelling this call aborts the room on both sides.

        ``out``: optional preallocated tensors to copy into; ``parts``: assemble the room from parts
        sent by several senders (see :meth:`start`).
        """
        with KnownAsyncLibrary():
            handle, driver = self._open_room(room, expected_tokens=expected_tokens, out=out, sender=sender,
                                             parts=parts)
            return await self._in_this_task(handle, driver, "receive()", handle._ended_result, handle.result)

    async def receive_leased(self, room: int | str, *, expected_tokens: int | None = None,
                             sender: str | None = None, parts: Sequence[Part] | None = None) -> Lease:
        """Receive ``room`` without copying it out of the pool: the rows stay in pool blocks,
        exposed as views under a :class:`Lease`. Release it promptly (``lease.release()``,
        ``async with lease:``, or use :meth:`lease`): its blocks are unavailable to other rooms until
        then. The whole request must fit the pool at once; a larger one fails with ``TransferFailed``.
        A room that ended is returned without a further wait: a cancel that came in the same loop step as its
        last frame reaches the caller at its next ``await``, with the lease in hand (release it, e.g. in a
        ``finally`` or with :meth:`lease`).
        """
        with KnownAsyncLibrary():
            handle, driver = self._open_room(room, expected_tokens=expected_tokens, zero_copy=True, sender=sender,
                                             parts=parts)
            return await self._in_this_task(handle, driver, "receive_leased()", handle._ended_lease, handle.lease)

    async def _in_this_task(self, handle: ReceiveHandle, driver: ReceiveRoomDriver | None, call: str,
                            ended: Callable[[], _T], wait: Callable[[], Awaitable[_T]]) -> _T:
        """Drive the room in the caller's task (no task, no wake-up), then return what ``ended`` makes of it: at
        once, for a room that ended (no wait: a loop turn would run others' tasks first). A room in parts runs in
        tasks of its own: ``wait`` for it. Cancelling ``call`` aborts the room."""
        try:
            if driver is not None:
                await driver.run(cancelled=f"{call} was cancelled")
                if handle.done:  # always, once run() returned
                    return ended()
            return await wait()
        except anyio.get_cancelled_exc_class():
            handle.cancel(f"{call} was cancelled")
            await self._until_ended(handle, driver)
            raise

    @staticmethod
    async def _until_ended(handle: ReceiveHandle, driver: ReceiveRoomDriver | None) -> None:
        """After cancelling a room whose tasks run on their own (a room in parts): until they ended. A part
        may be copying into the caller's ``out=`` in a thread, and the caller reuses those buffers once this
        call returned. (A room driven in the caller's task has ended already.)"""
        if driver is None:
            with anyio.CancelScope(shield=True):
                await handle.wait()

    @asynccontextmanager
    async def lease(self, room: int | str, *, expected_tokens: int | None = None,
                    sender: str | None = None, parts: Sequence[Part] | None = None) -> AsyncIterator[Lease]:
        """``async with receiver.lease(room) as lease:``: receive zero-copy, release on exit."""
        lease = await self.receive_leased(room, expected_tokens=expected_tokens, sender=sender, parts=parts)
        try:
            yield lease
        finally:
            lease.release()

    # -- introspection -----------------------------------------------------------------------

    @property
    def rooms_in_flight(self) -> int:
        """Rooms started and not yet ended."""
        return len(self._rooms)

    @property
    def fenced_blocks(self) -> dict[str, int]:
        """Blocks fenced now, by reason (also in ``allocator.stats.fenced``)."""
        counts = self.keeper.ledger.fenced_blocks()
        return {reason.name.lower(): counts[reason] for reason in FenceReason if counts[reason]}

    @property
    def room_ids_held(self) -> dict[str, int]:
        """Room ids that ended here with an error and may not be opened again yet, over every sender, by why:
        ``abort_unanswered`` (our ABORT is not answered: ``start()`` of the id raises ``InvalidRequest``) and
        ``barrier`` (a new attempt waits for the PONG of the PING sent after the end, one round trip). A
        count that stays up shows a sender that does not answer (a WARNING names it); the holds go with its
        session. Safe to read from another thread (a metrics scrape)."""
        total = {"abort_unanswered": 0, "barrier": 0}
        for conn in list(self._conns.values()):  # one C call: the loop may add or drop a connection meanwhile
            for why, n in conn.held_ids.counts().items():
                total[why] += n
        return total

    @property
    def senders(self) -> list[str]:
        """Addresses of the senders this receiver has a connection to."""
        return list(self._conns)

    def declare_sender_gone(self, sender: str | None = None) -> None:
        """Tell the receiver that a sender's process is gone for good (e.g. its host was retired).

        Blocks that sender may still write are then released after its transport's write lifetime,
        as when a restart is seen; until then they stay fenced. Only for an operator who knows:
        declaring a live sender gone can let its late writes corrupt other rooms.
        """
        conn = self._conns.get(self._sender_address(sender))
        if conn is None or conn.sender_id is None:
            return
        assert self._transport is not None
        log.warning("receiver[%d]: sender %s declared gone by the application", self.rank, conn.address)
        conn.session_lost(LossKind.DISCONNECTED, f"sender {conn.address} declared gone by the application")
        conn.sender_gone(conn.sender_id, "declared gone by the application")

    # -- internals ---------------------------------------------------------------------------

    def _unstarted_reservations(self) -> tuple[int, int]:
        """Rooms whose first reservation their sender has (INIT) but nothing of them came yet, and its blocks."""
        rooms = blocks = 0
        for conn in self._conns.values():
            for driver in conn.rooms.values():
                m = driver.machine
                if m.state is TransferStatus.WAITING_FOR_INPUT and m.total is None and m.allocated:
                    rooms += 1
                    blocks += self.allocator.blocks_for(m.allocated)
        return rooms, blocks

    def _forget(self, room: ReceiveRoomDriver) -> None:
        if self._rooms.get(room.room) is room:
            del self._rooms[room.room]
        if room.conn.rooms.get(room.room) is room:
            del room.conn.rooms[room.room]

    def _give_back_grants(self, grants: list[int]) -> None:
        ledger = self.keeper.ledger
        for g in grants:
            self.keeper.apply(ledger.consumed(g))

    def _check_out(self, out: Mapping[str, torch.Tensor] | None, zero_copy: bool) -> None:
        if out is None:
            return
        if zero_copy:
            raise InvalidRequest("out= and zero_copy=True exclude each other")
        if not isinstance(out, Mapping):
            raise InvalidRequest(f"out= must map each field name to a tensor, got {type(out).__name__}")
        if out.keys() != self._field_names:
            raise InvalidRequest(f"out= needs exactly the fields {list(self.layout)}, got {list(out)}")
        pool = self.pool.device
        spans = list(self._pool_spans)  # (device, start, end, what): nothing may overlap
        for name, f in self.layout.items():
            t = out[name]
            if not isinstance(t, torch.Tensor):
                raise InvalidRequest(f"out[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
            device = t.device
            on_cpu = device.type == "cpu"
            if not (on_cpu or device == pool):
                raise InvalidRequest(f"out[{name!r}] is on {device}; the pool is on {pool}: pass tensors on "
                                     f"{pool} or on the CPU")
            if (t.dtype != f.dtype or t.dim() != 1 + len(f.shape) or tuple(t.shape[1:]) != f.shape
                    or not t.is_contiguous()):
                shape = str(("n", *f.shape)).replace("'", "")
                raise InvalidRequest(f"out[{name!r}] must be contiguous {f.dtype} of shape {shape}, got {t.dtype} "
                                     f"{tuple(t.shape)}")
            n = t.numel()
            if n:
                start = t.data_ptr()
                spans.append(("cpu" if on_cpu else str(device), start, start + n * t.element_size(),
                              f"out[{name!r}]"))
        spans.sort()
        for (dev_a, _, end_a, a), (dev_b, start_b, _, b) in itertools.pairwise(spans):
            if dev_a == dev_b and start_b < end_a:
                # The copy would write one field's rows over another's (or over other rooms' blocks).
                raise InvalidRequest(f"{a} and {b} share memory: pass out= tensors that do not overlap each "
                                     "other or the receiver's pool")
