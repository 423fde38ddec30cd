"""One room on the receiver, driven through named steps: open, next_round, take_round, resume, fail,
finish.

The room owns at most two grants in flight (the round being written, and the one after it once announced
early: see ``_announce_early``) and the readable grants it holds (zero-copy rounds, or the round being copied
out). It never frees or fences blocks itself: it reports to the ledger, and the keeper carries out what the
ledger says. When the room ends with the sender possibly still writing, it sends ``ABORT`` and ends at once,
with its grants fenced: the sender's late ``ABORT_ACK`` releases them without the room waiting.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import anyio
import torch
from anyio.streams.memory import MemoryObjectSendStream

from aioembed.config import TransferConfig
from aioembed.errors import (
    AllocationTimeout,
    PeerDead,
    PlanError,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from aioembed.layout import Layout
from aioembed.memory.output import is_out_of_memory
from aioembed.memory.output_cache import OutputCache
from aioembed.memory.pool import BlockPool
from aioembed.metrics import TransferObserver, outcome_of
from aioembed.protocol.messages import (
    Abort,
    AbortAck,
    FenceRelease,
    Init,
    Progress,
    Reject,
    Resume,
    RoomId,
    Status,
    Total,
    TransferStatus,
    plain_text,
)
from aioembed.protocol.ownership import FenceReason, GrantState, Proof, Writer
from aioembed.protocol.room import Arrived, ReceiverRoomState
from aioembed.session.block_keeper import BlockKeeper
from aioembed.session.connection import LossKind, RoomEvent, SenderConnection, SessionLost
from aioembed.session.copy_out import RoundCopier
from aioembed.session.handle import Received, ReceiveHandle, TransferStats
from aioembed.session.lease import Lease, LeaseReturns
from aioembed.session.room_deadlines import RoomDeadlines
from aioembed.session.room_inbox import RoomInbox
from aioembed.session.stream import Chunk, LeasedChunk, StreamItem

__all__ = ["ReceiveRoomDriver", "RoomContext", "fresh_output", "short_fields"]

log = logging.getLogger("aioembed.session.receiver")

_INBOX = 16
_REOPENS = 3
CHUNK_PART_BYTES = 8 << 20
"""A copied room copies a chunk that landed within its round in parts of about this size, one thread,
looking for newly landed rows between parts (see ``ReceiveRoomDriver._copy_landing``)."""


def short_fields(out: Mapping[str, torch.Tensor], total: int) -> dict[str, int]:
    """The fields of ``out=`` with fewer than ``total`` rows, and how many they have."""
    return {n: int(t.shape[0]) for n, t in out.items() if t.shape[0] < total}


def fresh_output(outputs: OutputCache, layout: Layout, total: int, device: torch.device,
                 room: RoomId) -> dict[str, torch.Tensor]:
    """A copying room's new output of ``total`` tokens. Out of memory making it is a ``TransferFailed`` that says
    so and what to do, not an "internal error" with a traceback as for a bug (the room's blocks are settled and its
    sender told as for any failure)."""
    try:
        return outputs.empty(layout, total, device)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.warning("room=%r: out of memory making its output of %d tokens on %s", room, total, device)
        raise TransferFailed(f"room {room!r}: out of memory making its output of {total} tokens "
                             f"({total * layout.bytes_per_token} bytes on {device}): {why}; free memory, receive into "
                             "out= buffers you keep, or receive zero-copy (receive_leased())", room=room) from exc


@dataclass(frozen=True, slots=True)
class RoomContext:
    """What every room of one receiver shares."""

    keeper: BlockKeeper
    pool: BlockPool
    layout: Layout
    config: TransferConfig
    observer: TransferObserver
    copier: RoundCopier
    returns: LeaseReturns
    outputs: OutputCache
    deadlines: RoomDeadlines
    """Every room's deadlines (the room's and its waits'), kept by one task of the receiver's."""
    rank: int
    forget: Callable[[ReceiveRoomDriver], None]
    unstarted: Callable[[], tuple[int, int]]
    """Rooms whose first reservation was announced (INIT) and whose sender has sent nothing of them yet, and the
    blocks those reservations hold: what a first reservation that has to wait may be waiting behind."""


def _ends_room(event: RoomEvent) -> bool:
    return isinstance(event, (Abort, Reject, SessionLost)) or (
        isinstance(event, Status) and event.state in (TransferStatus.FAILED, TransferStatus.ABORTED))


@dataclass(eq=False)
class ReceiveRoomDriver:
    """The receiver's driver of one room."""

    room: RoomId
    handle: ReceiveHandle
    conn: SenderConnection
    ctx: RoomContext
    expected_tokens: int | None = None
    zero_copy: bool = False
    out: Mapping[str, torch.Tensor] | None = None
    exact_tokens: bool = False
    """A part of a room: the sender must send exactly ``expected_tokens`` rows."""
    stream: MemoryObjectSendStream[StreamItem] | None = None
    """A streamed room: chunks go here as they land (see :mod:`~aioembed.session.stream`)."""
    progress_tokens: int = 0
    """``PROGRESS`` asked for every this many tokens within a round (0: none): a streamed room hands each
    chunk out, a copied one copies it out while the rest of the round is written."""
    caller_stream: torch.cuda.Stream | None = None
    """A CUDA pool: the stream current when the caller asked for the room; copies out of the pool wait for
    the work queued on it (kernels may still read ``out``; see ``RoundCopier``)."""
    machine: ReceiverRoomState = field(init=False)
    writer: Writer | None = field(default=None, init=False)
    """The writer the room was announced to (``None`` until INIT)."""

    def __post_init__(self) -> None:
        cfg = self.ctx.config
        self.machine = ReceiverRoomState(self.room, block_size=cfg.block_size, max_tokens=cfg.max_request_tokens)
        # A room may get one PROGRESS per chunk of a round before its driver looks, for two rounds (the next one
        # may be announced early, and written as soon as this one ended): room for them.
        inbox = _INBOX + (2 * math.ceil(cfg.round_tokens / self.progress_tokens) if self.progress_tokens else 0)
        self._inbox = RoomInbox[RoomEvent](inbox)
        self._held: RoomEvent | None = None  # taken from the inbox ahead of its turn (see _fold_landed)
        self._next: int | None = None  # grant reserved or announced for the round in flight
        self._ahead: int | None = None  # grant of the round after it, announced early (before this one's STATUS)
        self._claim: int | None = None  # a zero-copy room's claim on the pool: the grant it is keyed to, once made
        self._round_seconds = 0.0  # how long the round that landed last took, from its announcement
        self._readable: list[tuple[int, int]] = []  # zero-copy: (grant, tokens), in token order
        self._landed: int | None = None
        """The grant of a round whose STATUS came, until it is copied out or handed on: nothing else refers to it,
        so a room that fails in between (its next RESUME refused) must consume it, or it stays READABLE for good."""
        self._split = 0  # zero-copy stream: blocks of the round's grant already handed out in chunks
        self._sender_ended = False
        self._wait_scope: anyio.CancelScope | None = None
        self._output: dict[str, torch.Tensor] | None = None
        self._metadata: dict[str, Any] = {}
        self._phases: dict[str, float] = {}
        self._round_started = 0.0
        self._ahead_at = 0.0  # when the round after the one in flight was announced (its write may start then)
        self._reopens = 0
        self._lost_reason: str | None = None  # why the room had to be opened again
        self._room_deadline = math.inf
        self._phase: tuple[str, float] | None = None  # (phase, timeout) while waiting for the sender
        self._expired_phase: tuple[str, float] | None = None  # the phase whose deadline cancelled the room
        self._violation: TransferError | None = None  # the sender broke the protocol outside the room's task

    # -- events from the connection ------------------------------------------------------------

    def deliver(self, event: RoomEvent) -> None:
        """A frame (or a session loss) for this room; never blocks."""
        try:
            self._inbox.put(event)
        except anyio.ClosedResourceError:
            log.debug("receiver[%d]: room=%r: %s after the room ended, ignored", self.ctx.rank, self.room, event)
            return
        except anyio.WouldBlock:
            # Said once per room: the frames of a flood come a batch at a time, and the room's task, which closes
            # the inbox, runs only after the batch (each frame past the first is the same news, at DEBUG).
            first = self._violation is None and not self.handle.done
            log.log(logging.ERROR if first else logging.DEBUG, "receiver[%d]: room=%r: sender flooded the room with "
                    "messages; failing it", self.ctx.rank, self.room)
            if first:
                # The sender broke the protocol, as with any bad frame: the room FAILS (not "aborted", as a
                # cancel by someone), and fail() tells the sender (ABORT naming this) so its blocks come back.
                self._violation = TransferFailed(
                    f"room {self.room!r}: protocol violation by sender {self.conn.address}: it sent more messages "
                    f"than the protocol allows ({self._inbox.capacity} waiting for the room)", room=self.room)
                scope = self.handle._scope
                assert scope is not None
                scope.cancel()
            return
        if self._wait_scope is not None and _ends_room(event):
            self._wait_scope.cancel()  # stop waiting for memory or a handshake: look at the event

    def session_lost(self, event: SessionLost) -> None:
        """The session of this room's sender ended (announced in it, or still opening)."""
        if self.writer is None or event.writer == self.writer:
            self.deliver(event)

    # -- the task ------------------------------------------------------------------------------

    async def run(self, *, cancelled: str = "cancelled") -> None:
        """The room's task (or the ``receive()`` caller's): runs until a result or a typed error is in the
        handle; ``cancelled`` is the reason given when the task running it is cancelled.

        One cancel scope (the handle's) is what every deadline of the room cancels: ``room_timeout`` for the
        whole room, and while the room waits for the sender, the current phase's (``input_timeout``,
        ``round_timeout``), whichever comes first; a deadline passing ends the room with a
        ``TransferTimeout`` naming it. The deadlines themselves are kept by the receiver's one task
        (``ctx.deadlines``), not by loop timers. (Fewer scopes and timers per room: small requests are
        dominated by such fixed costs.)"""
        cfg = self.ctx.config
        t_start = time.perf_counter()
        result: Received | Lease | None = None
        error: TransferError | None = None
        scope = self.handle._scope
        assert scope is not None
        deadlines = self.ctx.deadlines
        self._room_deadline = anyio.current_time() + cfg.room_timeout
        deadlines.set(self, self._room_deadline, scope.cancel)
        try:
            with scope:
                await self.open()
                while not await self.step():
                    pass
                result = self.result(t_start)
            if result is None and self._violation is not None:
                raise self._violation
            if result is None and scope.cancelled_caught and self.handle._cancel_reason is None:
                raise self._deadline_passed()
        except TransferError as exc:
            error = exc
        except ProtocolError as exc:
            error = TransferFailed(f"room {self.room!r}: protocol violation by sender {self.conn.address}: {exc}",
                                   room=self.room)
        except Exception as exc:  # a bug: fail the room loudly, keep the receiver alive
            log.exception("receiver[%d]: room=%r: internal error", self.ctx.rank, self.room)
            error = TransferFailed(f"room {self.room!r}: internal error: {exc!r}", room=self.room)
        finally:  # synchronous: a cancellation cannot cut it short
            deadlines.drop(self)
            if result is None and error is None:
                error = TransferAborted(f"room {self.room!r}: {self.handle._cancel_reason or cancelled}",
                                        room=self.room)
            try:
                if error is not None:
                    self.fail(error)
            finally:  # even if ending it raised (a bug): the room leaves every table, its handle resolves
                self.finish(result, error, t_start)

    async def step(self) -> bool:
        """Wait for the next event and act on it; True once every token is in."""
        arrived = await self.next_round()
        if arrived is None:
            return False
        rows, grant = arrived
        if rows.partial and self.stream is None:  # only copied rooms and streams ask for PROGRESS
            rest = await self._copy_landing(rows, grant)
            if rest is None:
                return False
            rows = rest
        return await self.take_round(rows, grant)

    async def _copy_landing(self, arrived: Arrived, grant: int) -> Arrived | None:
        """A copied room's chunk landed (``PROGRESS``) while the rest of its round is still being written:
        copy it out on one thread, a part at a time, folding in the rows that frames queued meanwhile
        announce. Returns the rows not yet copied once the round's ``STATUS`` is among them (the round's
        end copies them, spread over the copy threads), or ``None`` once every announced row is copied.

        Chunks written at once end together: copied one by one, the first would take one thread while its
        round's end waited behind it; checking between parts lets the end take the copy threads at once.
        A CUDA pool copies each chunk whole (a device-to-host copy per part would cost a thread hop and an
        event wait each; its copies take one thread anyway)."""
        self.handle._set_status(TransferStatus.TRANSFERRING)
        bs, bpt = self.ctx.config.block_size, self.ctx.layout.bytes_per_token
        part = max(1, CHUNK_PART_BYTES // (bs * bpt)) * bs
        whole = self.ctx.pool.device.type == "cuda"
        while True:
            arrived = self._fold_landed(arrived)
            if not arrived.partial:
                return arrived  # take_round keeps its metadata
            if arrived.metadata is not None:
                self._metadata = dict(arrived.metadata)
            if arrived.count == 0:
                return None
            # Up to 1.5 parts go whole, so a last part is never small enough to be copied on the loop.
            n = arrived.count if whole or arrived.count <= part * 3 // 2 else part
            await self._copy(grant, dataclasses.replace(arrived, count=n), consume=False)
            arrived = dataclasses.replace(arrived, start=arrived.start + n, count=arrived.count - n, metadata=None,
                                          offset=arrived.offset + n)

    def _take_event(self) -> RoomEvent:
        """The next event: one held back by :meth:`_fold_landed` first, else the inbox's (``anyio.WouldBlock``
        when there is none)."""
        if self._held is not None:
            event, self._held = self._held, None
            return event
        return self._inbox.get_nowait()

    def _fold_landed(self, arrived: Arrived) -> Arrived:
        """``arrived`` extended by the rows that the ``PROGRESS`` / ``STATUS`` frames already in the inbox
        announce, up to the round's end. Any other event stays first in line for :meth:`next_round`, and
        nothing is folded in past it (the rows already announced are still copied, as before it came)."""
        while arrived.partial and self._held is None:
            try:
                event = self._inbox.get_nowait()
            except anyio.WouldBlock:
                break
            if not isinstance(event, Progress | Status):
                self._held = event
                break
            folded = self._on_frame(event)  # a failed STATUS raises: the room ends as it would next step
            assert folded is not None
            more = folded[0]
            arrived = dataclasses.replace(arrived, count=arrived.count + more.count, total=more.total,
                                          complete=more.complete, metadata=arrived.metadata or more.metadata,
                                          partial=more.partial)
        return arrived

    # -- steps ---------------------------------------------------------------------------------

    async def open(self) -> None:
        """Handshake (if needed), first reservation, INIT."""
        cfg, keeper = self.ctx.config, self.ctx.keeper
        if self.room in self.conn.held_ids:
            await self._wait_id_released()
        while True:
            t0 = time.perf_counter()
            if self.conn.ready and self.conn.writer is not None:
                writer = self.conn.writer  # the usual case: no wait, no scope
                self._add_phase("handshake", t0)
            else:
                with anyio.CancelScope() as scope:
                    self._wait_scope = scope
                    try:
                        writer = await self.conn.wait_ready(cfg.handshake_timeout, room=self.room)
                    finally:
                        self._wait_scope = None
                self._add_phase("handshake", t0)
                if scope.cancelled_caught:
                    self._interrupted(None)
                    continue
            tokens = self._first_tokens()
            grant = await self._reserve(tokens, first=True)
            if grant is None:
                self._interrupted(writer)
                continue
            if self.conn.ready and self.conn.writer == writer:
                break
            keeper.apply(keeper.ledger.release_unannounced(grant))  # the session changed meanwhile
        blocks = keeper.blocks_of(grant)
        exact = self.expected_tokens if self.exact_tokens and self.expected_tokens is not None else 0
        self._announce(grant, writer, Init(room=self.room, blocks=blocks, allocated_tokens=tokens,
                                           expected_ranks=self.conn.world, progress_tokens=self.progress_tokens,
                                           exact_tokens=exact))
        self.machine.init_sent(blocks=len(blocks), allocated_tokens=tokens, progress_tokens=self.progress_tokens)
        self.handle._set_status(TransferStatus.WAITING_FOR_INPUT)

    async def _wait_id_released(self) -> None:
        """The id's earlier attempt failed an instant ago: what the sender still says about it comes before
        the PONG we wait for (a live sender answers at once; a silent one loses the session, which releases
        the id). Bounded by ``handshake_timeout`` against a peer that answers heartbeats but not this."""
        timeout = self.ctx.config.handshake_timeout
        with anyio.move_on_after(timeout):
            await self.conn.wait_released(self.room)
            return
        raise TransferTimeout(f"room {self.room!r}: sender {self.conn.address} did not answer, within "
                              f"handshake_timeout={timeout} s, the PING sent after this room id's earlier "
                              "attempt failed (its answers about that attempt come first)", room=self.room,
                              phase="id_release")

    async def next_round(self) -> tuple[Arrived, int] | None:
        """Wait for the sender's next word; returns the round that landed (and its grant), or ``None``
        when the room had to be opened again."""
        t0 = time.perf_counter()
        try:
            event = self._take_event()
        except anyio.WouldBlock:
            cfg, scope, deadlines = self.ctx.config, self.handle._scope, self.ctx.deadlines
            assert scope is not None
            waiting = self.machine.state is TransferStatus.WAITING_FOR_INPUT
            phase, timeout = ("input", cfg.input_timeout) if waiting else ("round", cfg.round_timeout)
            self._phase = (phase, timeout)
            deadlines.set(self.handle, anyio.current_time() + timeout, self._phase_expired)  # the room's: the driver's
            try:
                event = await self._inbox.get()
            finally:
                deadlines.drop(self.handle)
            self._phase = None
        self._add_phase("wait", t0)
        if isinstance(event, SessionLost):
            return await self._on_session_lost(event)
        if isinstance(event, Total):
            self._on_total(event)
            return None
        if isinstance(event, FenceRelease):  # no fence of this room came before it: the ledger frees only fenced grants
            self.conn.late(event, self.room, self.writer)
            return None
        return self._on_frame(event)

    async def take_round(self, arrived: Arrived, grant: int) -> bool:
        """A round (or a chunk of one) landed: announce the next round early if memory allows,
        copy, keep or hand out these rows."""
        self.handle._set_status(TransferStatus.TRANSFERRING)
        if arrived.metadata is not None:
            self._metadata = dict(arrived.metadata)
        if arrived.partial:  # a stream's chunk (a copied room's go through _copy_landing)
            assert self.stream is not None
            await self._deliver(arrived, grant)
            return False
        self.ctx.observer.round_finished(side="receiver", seconds=self._round_seconds)
        if self.zero_copy and self.stream is None:  # a whole-room lease keeps every round
            self._trim(grant, arrived.count)
            self._readable.append((grant, arrived.count))
            self._landed = None
            if self._claim is None:
                self._admit_zero_copy(arrived.total, grant)
        if not arrived.complete:
            self._resume_now(arrived)
        if self.stream is not None:
            await self._deliver(arrived, grant)
        elif not self.zero_copy:
            await self._copy(grant, arrived)
        if arrived.complete:
            return True
        if self._next is None:  # the pool was short: wait for memory now that this round is out
            tokens = self._round_tokens(arrived.remaining)
            late = await self._reserve(tokens, first=False)
            if late is not None:
                self.resume(late, tokens)
                self._announce_early()  # and the round after it, if the pool has room to spare now
        return False

    def _resume_now(self, arrived: Arrived) -> None:
        """A round that is not the last landed: announce the next one now if the pool has its blocks (before this
        one is copied out), or, if the next one was announced early and is being written, the one after it."""
        if self._next is not None:
            self._announce_early()
            return
        tokens = self._round_tokens(arrived.remaining, shrink=False)
        early = self.ctx.keeper.try_reserve(self.room, tokens, priority=True, round=self.machine.round + 1)
        if early is not None:
            self.resume(early, tokens)
            self._announce_early()  # a miss of an earlier try does not end the head start for good

    def _admit_zero_copy(self, total: int, first_grant: int) -> None:
        """A zero-copy room keeps every round until its lease is released, so once its total is known
        it claims the blocks of the whole request: admitted if they fit beside the claims of other
        zero-copy rooms and leases, else failed now, saying why (two such rooms waiting for each other
        would otherwise hold the pool until ``round_timeout``)."""
        pool, keeper = self.ctx.pool, self.ctx.keeper
        if total > pool.num_tokens:
            raise TransferFailed(f"room {self.room!r}: {total} tokens cannot be received zero-copy into "
                                 f"a pool of {pool.num_tokens} tokens; use receive()", room=self.room)
        need = -(-total // pool.block_size)
        others = keeper.claimed_blocks
        if need > pool.num_blocks - others:
            raise TransferFailed(
                f"room {self.room!r}: {total} tokens ({need} blocks) cannot be received zero-copy now: "
                f"leases and zero-copy rooms in flight hold {others} of the pool's {pool.num_blocks} blocks "
                "until they are released; release leases sooner, or receive() this room", room=self.room)
        keeper.claim(first_grant, need)
        self._claim = first_grant

    def _announce_early(self) -> None:
        """Announce the round after the one in flight (RESUME) before that one's STATUS, so that the sender writes
        it as soon as that one ended: when the total is known (TOTAL, or a STATUS) and a round follows, not for a
        stream (it hands chunks out round by round), and only if the pool has the blocks now (a room short of memory
        reserves after the STATUS, waiting as before). A zero-copy room is admitted first (its claim covers the whole
        request). Tried again at each STATUS, so one miss does not end the head start for the rest of the room."""
        m = self.machine
        if self._ahead is not None or self._next is None or self.stream is not None or m.total is None or m.ahead:
            return
        remaining = m.total - (m.received + m.allocated)
        if remaining <= 0:
            return
        if self.zero_copy and self._claim is None:
            self._admit_zero_copy(m.total, self._next)
        tokens = self._round_tokens(remaining, shrink=False)
        cfg = self.ctx.config
        # A zero-copy room keeps every round anyway, within its claim: its RESUME after the STATUS would take
        # priority too. A copied room's is a third round of blocks at its peak (one copied out, one written, this
        # one): only blocks nobody waits for, with the slice kept for resume rounds left free.
        keep = 0 if self.zero_copy else cfg.resume_reserve // cfg.block_size
        grant = self.ctx.keeper.try_reserve(self.room, tokens, priority=self.zero_copy, keep_free=keep,
                                            round=m.round + 1)
        if grant is not None:
            self.resume(grant, tokens)

    def resume(self, grant: int, tokens: int) -> None:
        """Announce ``grant`` for the next round (RESUME), unless the room's session is gone."""
        keeper, m = self.ctx.keeper, self.machine
        if self.writer is None or not self.conn.ready or self.conn.writer != self.writer:
            keeper.apply(keeper.ledger.release_unannounced(grant))  # the SessionLost is in the inbox
            return
        blocks = keeper.blocks_of(grant)
        early = self._next is not None  # the round before it is still being written
        round_, start = m.resume_sent(blocks=len(blocks), allocated_tokens=tokens)
        self._announce(grant, self.writer, Resume(room=self.room, round=round_, sent_tokens=start,
                                                  blocks=blocks, allocated_tokens=tokens), ahead=early)
        log.debug("receiver[%d]: room=%r: RESUME round %d%s, from token %d of %s, %d reserved", self.ctx.rank,
                  self.room, round_, " (early)" if early else "", start, m.total, tokens)

    def fail(self, error: TransferError) -> None:
        """End the room: tell the sender if it may still write, hand every grant to the ledger."""
        keeper, ledger = self.ctx.keeper, self.ctx.keeper.ledger
        self.machine.fail(str(error))
        alive = self.writer is not None and self.conn.ready and self.conn.writer == self.writer
        announced = []
        for grant in self._take_grants():
            state = ledger.grant(grant).state
            if state is GrantState.RESERVED:
                keeper.apply(ledger.release_unannounced(grant))
            elif state is GrantState.ANNOUNCED:
                announced.append(grant)
        told = False
        if alive and not self._sender_ended and self.writer is not None:
            # The sender holds the room (writing, or waiting for input or a RESUME): end it there. An ABORT that
            # cannot be queued (the sender reads nothing) ends the session instead: fenced as for a sender gone.
            told = self.conn.send(Abort(room=self.room, reason=plain_text(error)))
            if told:
                self.conn.held_ids.abort_sent(self.room, anyio.current_time())
        for grant in announced:
            keeper.fence(grant, FenceReason.ABORT_UNACKED if told else FenceReason.SESSION_DROPPED)
        for g, _ in self._readable:
            keeper.apply(ledger.consumed(g))  # fully written and announced: nothing can reach them
        self._readable = []
        if self._landed is not None:  # its STATUS came (its write is over), it was neither copied nor handed out
            keeper.apply(ledger.consumed(self._landed))
            self._landed = None
        self._end_claim()

    def abandon(self) -> None:
        """Undo the set-up of a driver that will never run (the other parts of its room could not start):
        it reserved nothing, announced nothing."""
        self.ctx.forget(self)
        self._inbox.close()

    def finish(self, result: Received | Lease | None, error: TransferError | None, t_start: float) -> None:
        """Leave the connection's and the receiver's tables, report, resolve the handle."""
        self.ctx.forget(self)
        self._output = None  # the result holds it now: the caller's drop alone gives its memory back
        self._inbox.close()
        self._hand_over_pending_frames()
        if self.stream is not None:
            self.stream.close()  # the consumer sees the end (and then the handle's error, if any)
        m = self.machine
        outcome = outcome_of(error if result is None else None)
        nbytes = (m.total or 0) * self.ctx.layout.bytes_per_token
        self.ctx.observer.room_finished(side="receiver", outcome=outcome, nbytes=nbytes, rounds=m.round + 1,
                                        seconds=time.perf_counter() - t_start)
        self.ctx.observer.sender_room_finished(sender=self.conn.address, outcome=outcome, nbytes=nbytes)
        if result is not None:
            self.handle._finish(result=result, status=TransferStatus.SUCCESS)
            log.debug("receiver[%d]: room=%r: done, %d tokens in %d rounds", self.ctx.rank, self.room,
                      result.num_tokens, result.rounds)
        else:
            assert error is not None
            status = TransferStatus.ABORTED if isinstance(error, TransferAborted) else TransferStatus.FAILED
            self.handle._finish(error=error, status=status)
            log.info("receiver[%d]: room=%r: %s: %s", self.ctx.rank, self.room, status.name, error)
            if self.writer is not None and self.conn.writer == self.writer:
                self.conn.end_barrier(self.room)  # after the handle: it cannot leave it unresolved

    def _hand_over_pending_frames(self) -> None:
        """Frames still in the inbox when the room ended (e.g. the sender's final STATUS, delivered just as
        the caller cancelled) are proofs about the room's fenced blocks: they go to the connection as
        late answers, like frames arriving after the end. Dropping them could fence blocks for ever."""
        while True:
            try:
                event = self._take_event()
            except anyio.WouldBlock:
                return
            if not isinstance(event, SessionLost):
                self.conn.late(event, self.room, self.writer)

    def result(self, t_start: float) -> Received | Lease:
        """The finished request: copied tensors, or a lease on the readable grants."""
        m = self.machine
        assert m.total is not None
        stats = TransferStats(bytes=m.total * self.ctx.layout.bytes_per_token, rounds=m.round + 1,
                              seconds=time.perf_counter() - t_start, phases=self._phases)
        if self.stream is not None:  # the rows went out in chunks; the handle's result is a summary
            return Received(room=self.room, tensors=self._output or {}, metadata=self._metadata, num_tokens=m.total,
                            rounds=m.round + 1, stats=stats)
        if self.zero_copy:
            kept, self._readable = self._readable, []
            return Lease(room=self.room, views=self._lease_views(kept), metadata=self._metadata,
                         num_tokens=m.total, rounds=m.round + 1, stats=stats, grants=[g for g, _ in kept],
                         returns=self.ctx.returns)
        assert self._output is not None
        return Received(room=self.room, tensors=self._output, metadata=self._metadata, num_tokens=m.total,
                        rounds=m.round + 1, stats=stats)

    # -- event handling ------------------------------------------------------------------------

    def _on_frame(self, event: Status | Progress | Abort | AbortAck | Reject) -> tuple[Arrived, int] | None:
        keeper, ledger = self.ctx.keeper, self.ctx.keeper.ledger
        grant = self._next
        if isinstance(event, Abort):
            self._sender_ended = True
            self._end_grant(Proof.SENDER_ABORT)  # the sender sends ABORT only once its writes are over
            self.conn.send(AbortAck(room=self.room))
            raise TransferAborted(f"room {self.room!r}: aborted by sender {self.conn.address}: {event.reason}",
                                  room=self.room)
        if isinstance(event, Reject):
            # Not the sender's end of the room: a refused frame leaves its room (and this rank) going there,
            # and the REJECT names the refused frame only in its text (for the error below), so no frame of
            # ours is known to be void. fail() ABORTs the room and fences what we announced; the ABORT's
            # answer, which comes once nothing of the room can move, frees it.
            if self._lost_reason is not None and self.machine.received == 0:
                raise PeerDead(f"room {self.room!r}: {self._lost_reason}; opened again, sender "
                               f"{self.conn.address} refused it: {event.reason}", room=self.room)
            raise TransferFailed(f"room {self.room!r}: sender {self.conn.address} rejected it: {event.reason}",
                                 room=self.room)
        if isinstance(event, AbortAck):
            raise ProtocolError(f"room {self.room!r}: ABORT_ACK without an ABORT", room=self.room)
        if isinstance(event, Progress):
            if grant is None:
                raise ProtocolError(f"room {self.room!r}: PROGRESS with no reservation outstanding", room=self.room)
            landing = self.machine.on_progress(event)
            if (error := self._part_total_error(landing.total)) is not None:
                raise error  # the round's write goes on: its grant stays announced (fail() fences it, ABORTs)
            return landing, grant
        arrived = self.machine.on_status(event)
        if arrived is None:  # a final FAILED / ABORTED
            self._sender_failed(event)
        assert grant is not None  # on_status accepts data only with a reservation outstanding
        if event.inline:
            self._take_inline(event, arrived, grant)
        if (error := self._part_total_error(arrived.total)) is not None:
            # Its write is over (the STATUS says so); the room is not, nor a round announced early (fail() fences it).
            self._end_grant(Proof.STATUS, ahead=False)
            raise error
        self._next, self._ahead = self._ahead, None  # a round announced early is the one in flight now
        now = time.perf_counter()
        self._round_seconds = now - self._round_started
        if self._next is not None:
            self._round_started = self._ahead_at
        keeper.apply(ledger.landed(grant))  # only this room moves its announced grant: still ANNOUNCED
        self._landed = grant
        if arrived.complete:
            self._sender_ended = True
        return arrived, grant

    def _take_inline(self, event: Status, arrived: Arrived, grant: int) -> None:
        """Rows the STATUS brought itself (``Status.inline``) go into the round's blocks before the round counts
        as landed: no more than this receiver said it takes, of fields it has, exactly the rows of a round that
        this STATUS alone announces (the sender carries none in a round with PROGRESS)."""
        ctx = self.ctx
        limit = ctx.pool.status_inline_budget(ctx.config.status_inline_bytes)
        size = sum(len(data) for _, data in event.inline)
        why = None
        if size > limit:
            why = (f"carries {size} bytes of rows inline; this receiver takes at most {limit} "
                   "(status_inline_bytes, a CPU pool)")
        elif arrived.offset:
            why = f"carries rows inline after a PROGRESS announced rows of the round ({arrived.offset} tokens)"
        else:
            try:
                ctx.pool.write_rows(self._rows_of(grant, arrived), event.inline, arrived.count)
                ctx.observer.rows_inline(side="receiver", nbytes=size)
                return
            except PlanError as exc:
                why = f"carries rows inline that do not fit its {arrived.count} tokens: {exc}"
        # The STATUS says the round's write is over, as for a wrong total below: its blocks need no fence.
        self._end_grant(Proof.STATUS, ahead=False)
        raise ProtocolError(f"room {self.room!r}: STATUS of round {event.round} {why}", room=self.room)

    def _on_total(self, event: Total) -> None:
        """The sender's TOTAL, as round 0 is written: the room is longer than round 0's reservation."""
        self.machine.on_total(event)
        if (error := self._part_total_error(event.total_tokens)) is not None:
            raise error  # round 0's write goes on: its grant stays announced (fail() fences it, ABORTs)
        self._announce_early()

    def _part_total_error(self, total: int) -> TransferFailed | None:
        """A part received with ``exact_tokens`` must be as long as its range says, from its first frame on."""
        if not self.exact_tokens or total == self.expected_tokens:
            return None
        return TransferFailed(f"room {self.room!r}: sender {self.conn.address} sends {total} tokens for "
                              f"this part, the receiver expects {self.expected_tokens} (its Part range)",
                              room=self.room)

    def _sender_failed(self, event: Status) -> NoReturn:
        """The sender's final FAILED / ABORTED STATUS: settle the grants (fenced if a write may still land),
        then raise the room's error."""
        self._sender_ended = True
        if event.fence:
            for g in self._take_grants():
                self.ctx.keeper.fence(g, FenceReason.WRITE_FAILED)
        else:
            self._end_grant(Proof.STATUS)  # no write of the room may land (else it says fence): nor into a round ahead
        if self._lost_reason is not None and self.machine.received == 0:
            raise PeerDead(f"room {self.room!r}: {self._lost_reason}; opened again, sender "
                           f"{self.conn.address} reported {self.machine.state.name}: {self.machine.error}",
                           room=self.room)
        cls = TransferAborted if self.machine.state is TransferStatus.ABORTED else TransferFailed
        raise cls(f"room {self.room!r}: sender {self.conn.address} reported {self.machine.state.name}: "
                  f"{self.machine.error}", room=self.room)

    def _phase_expired(self) -> None:
        """The deadline of the wait in :meth:`next_round` passed: cancel the room, noting the phase. The cancellation
        may land only at the room's next checkpoint: a frame that came in the same loop turn wakes the wait first,
        which then clears ``_phase`` (on trio, and on asyncio when the wait's future was already done); the room
        then reported "exceeded room_timeout" after only the phase's timeout."""
        self._expired_phase = self._phase
        scope = self.handle._scope
        assert scope is not None
        scope.cancel()

    def _deadline_passed(self) -> TransferTimeout:
        """The error for the deadline that ended the room: the phase it was waiting in, or the room's."""
        expired = self._expired_phase
        if expired is None and self._phase is not None and anyio.current_time() < self._room_deadline:
            expired = self._phase
        if expired is not None:
            phase, timeout = expired
            return TransferTimeout(f"room {self.room!r}: timed out after {timeout} s in phase {phase!r} "
                                   f"(receiver rank {self.ctx.rank}, sender {self.conn.address})", room=self.room,
                                   phase=phase)
        return TransferTimeout(f"room {self.room!r}: exceeded room_timeout={self.ctx.config.room_timeout} s",
                               room=self.room, phase="room")

    def _interrupted(self, waited_in: Writer | None) -> None:
        """A wait of :meth:`open` was cut short by the sender's session ending: try the next session if
        the sender may still serve the room, else fail now (not after an allocation timeout).

        Only the loss of the session the wait was in (``waited_in``; ``None``: a wait for a handshake) decides.
        A room before its INIT is told of every loss, also of one that came while it was in no wait this cuts
        (its id's release, a reservation granted as the session ended): that loss is still in the inbox, ahead
        of the one that cut this wait, and says nothing about the sender now (it went silent, then came back;
        it dropped a session, and now is silent). Dropped here, as :meth:`_on_session_lost` drops it after INIT."""
        assert self._held is None  # events are held only while a chunk is copied, after INIT
        while True:
            try:
                event = self._inbox.get_nowait()
            except anyio.WouldBlock:
                return
            if not isinstance(event, SessionLost):
                raise TransferFailed(f"room {self.room!r}: unexpected {event!r} before INIT", room=self.room)
            if event.writer == waited_in:
                break
            log.debug("receiver[%d]: room=%r: the loss of session %d (%s), which it did not wait in, ignored",
                      self.ctx.rank, self.room, event.writer.epoch, event.kind.value)
        if event.kind is LossKind.DROPPED and self._reopens < _REOPENS:
            self._reopens += 1
            self._lost_reason = event.reason
            return
        raise PeerDead(f"room {self.room!r}: {event.reason}", room=self.room)

    async def _on_session_lost(self, event: SessionLost) -> tuple[Arrived, int] | None:
        if event.writer != self.writer:
            return None  # about a session this room was not announced in (it reopened since)
        reason = FenceReason.PEER_SILENT if event.kind is LossKind.SILENT else FenceReason.SESSION_DROPPED
        for grant in self._take_grants():  # the writer may still reach them: fenced, freed by a later proof
            self.ctx.keeper.fence(grant, reason)
        # Rows announced by PROGRESS count (a stream may have handed them out): such a room cannot start over.
        nothing_in = self.machine.landed == 0 and not self._readable
        if event.kind is LossKind.DROPPED and nothing_in and self._reopens < _REOPENS:
            # The sender never wrote this room in that session (it restarted, or dropped us first):
            # open it again in the next session instead of failing it.
            self._reopens += 1
            self._lost_reason = event.reason
            log.info("receiver[%d]: room=%r: session lost before any data (%s); opening the room again",
                     self.ctx.rank, self.room, event.reason)
            cfg = self.ctx.config
            self.machine = ReceiverRoomState(self.room, block_size=cfg.block_size, max_tokens=cfg.max_request_tokens)
            self.writer = None
            self._end_claim()  # the next attempt claims again, keyed to its own first grant
            self.handle._set_status(TransferStatus.BOOTSTRAPPING)
            await self.open()
            return None
        self._sender_ended = True
        raise PeerDead(f"room {self.room!r}: {event.reason}", room=self.room)

    def _end_claim(self) -> None:
        """A zero-copy room that will hand out no lease lets go of its claim on the pool. Made at TOTAL, the claim
        is keyed to round 0's grant, which a failed room leaves fenced (not freed) for as long as a write may reach
        it: the claim would count against other zero-copy rooms all that time."""
        if self._claim is not None:
            self.ctx.keeper.unclaim(self._claim)
        self._claim = None

    def _take_grants(self, *, ahead: bool = True) -> list[int]:
        """The grant of the round in flight and, with ``ahead``, of one announced early: the room lets go of them."""
        grants = [g for g in ((self._next, self._ahead) if ahead else (self._next,)) if g is not None]
        self._next = None
        if ahead:
            self._ahead = None
        return grants

    def _end_grant(self, proof: Proof, *, ahead: bool = True) -> None:
        """``proof`` ends the writes into the round in flight, and with ``ahead`` into a round announced early."""
        keeper = self.ctx.keeper
        for grant in self._take_grants(ahead=ahead):
            keeper.apply(keeper.ledger.ended(grant, proof))

    # -- helpers -------------------------------------------------------------------------------

    def _announce(self, grant: int, writer: Writer, msg: Init | Resume, *, ahead: bool = False) -> None:
        """``ahead``: the round after the one in flight (an early RESUME)."""
        if ahead:
            self._ahead = grant
        else:
            self._next = grant
        if self.conn.closed:  # not announced: the grant stays reserved, and fail() frees it
            raise TransferFailed(f"room {self.room!r}: the connection to sender {self.conn.address} was closed",
                                 room=self.room)
        self.ctx.keeper.ledger.announce(grant, writer)
        self.writer = writer
        if not self.conn.send(msg):  # dropped, and the session with it: the room fails (fail() fences the grant)
            raise TransferFailed(f"room {self.room!r}: sender {self.conn.address} reads nothing (its control "
                                 f"socket refuses more frames): {type(msg).__name__} not sent", room=self.room)
        if ahead:
            self._ahead_at = time.perf_counter()
        else:
            self._round_started = time.perf_counter()

    async def _reserve(self, tokens: int, *, first: bool) -> int | None:
        """A grant for ``tokens``, or ``None`` if the room ended while waiting for memory."""
        cfg = self.ctx.config
        t0 = time.perf_counter()
        self.ctx.returns.drain()  # leases dropped without release (queued by their finalizers) first
        keep = cfg.resume_reserve // cfg.block_size if first else 0
        round_ = 0 if first else self.machine.round + 1
        grant = self.ctx.keeper.try_reserve(self.room, tokens, priority=not first, keep_free=keep, round=round_)
        if grant is not None:  # free blocks and nobody waiting before us (FIFO kept): no wait, no scope
            self._add_phase("allocate", t0)
            return grant
        try:
            with anyio.CancelScope() as scope:
                self._wait_scope = scope
                grant = await self.ctx.keeper.reserve(self.room, tokens, timeout=cfg.round_timeout,
                                                      priority=not first, keep_free=keep, round=round_,
                                                      on_wait=self._held_chunks_note if self._holds_chunks(first)
                                                      else None)
        except AllocationTimeout as exc:
            # A first reservation's note is made only now (a task per waiting room to say it sooner cost every
            # wait a task group): the error names it, and so does a warning (BlockKeeper.wait_note).
            held = self._pool_holders_note() if first else self._held_chunks_note()
            if held and first:
                self.ctx.keeper.wait_note(self.room, tokens, held, timed_out=True)
            raise TransferTimeout(f"room {self.room!r}: {exc}{'; ' + held if held else ''}", room=self.room,
                                  phase="allocate") from None
        finally:
            self._wait_scope = None
        self._add_phase("allocate", t0)
        return grant

    def _trim(self, grant: int, rows: int) -> None:
        """A readable grant a lease will hold keeps only the blocks of its ``rows`` (see ``BlockLedger.trim``):
        a short request's lease held its whole reservation (``default_tokens``), past its zero-copy claim."""
        keeper = self.ctx.keeper
        keeper.apply(keeper.ledger.trim(grant, max(1, -(-rows // self.ctx.config.block_size))))

    def _rows_of(self, grant: int, arrived: Arrived) -> tuple[int, ...]:
        """The blocks of ``grant`` holding ``arrived``'s rows (from its offset in the round on)."""
        skip = arrived.offset // self.ctx.config.block_size - self._split
        return self.ctx.keeper.blocks_of(grant)[skip:]

    async def _copy(self, grant: int, arrived: Arrived, *, consume: bool = True) -> None:
        keeper = self.ctx.keeper
        t0 = time.perf_counter()
        try:
            if self._output is None:
                self._output = self._make_output(arrived.total)
            await self.ctx.copier.copy(self._rows_of(grant, arrived), self._output, arrived.start, arrived.count,
                                       spread=not arrived.partial, after=self.caller_stream)
        finally:
            if consume:
                keeper.apply(keeper.ledger.consumed(grant))  # read (or given up): nothing else writes it
                if grant == self._landed:
                    self._landed = None
        self._add_phase("copy", t0)

    async def _deliver(self, arrived: Arrived, grant: int) -> None:
        """Streaming: hand rows ``arrived`` to the caller, copied out or as a leased chunk.

        A chunk within a round (``partial``) is copied from the announced grant (its blocks are whole and
        their write ended), or, zero-copy, split off it into a readable grant of its own; at the round's
        end the rest of the grant is copied and freed, or handed out whole."""
        assert self.stream is not None
        keeper, ledger, bs = self.ctx.keeper, self.ctx.keeper.ledger, self.ctx.config.block_size
        end = arrived.start + arrived.count
        item: StreamItem
        if not self.zero_copy:
            await self._copy(grant, arrived, consume=not arrived.partial)
            assert self._output is not None
            item = Chunk(room=self.room, start=arrived.start, end=end, total=arrived.total, metadata=self._metadata,
                         tensors={n: t[arrived.start:end] for n, t in self._output.items()})
        else:
            held = grant
            if arrived.partial:
                held = ledger.split(grant, arrived.count // bs)
                self._split += arrived.count // bs
            else:
                self._trim(held, arrived.count)  # the round's last chunk: the grant's rest holds no row
            views: dict[str, list[torch.Tensor]] = {name: [] for name in self.ctx.layout}
            for name, vs in self.ctx.pool.views(keeper.blocks_of(held), arrived.count).items():
                views[name].extend(vs)
            item = LeasedChunk(room=self.room, start=arrived.start, end=end, total=arrived.total, views=views,
                               metadata=self._metadata, grants=[held], returns=self.ctx.returns)
            if held == self._landed:
                self._landed = None  # the chunk's lease holds it now
        if not arrived.partial:
            self._split = 0
        try:
            self.stream.send_nowait(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):  # the caller closed the stream
            if isinstance(item, LeasedChunk):
                item.release()
            raise TransferAborted(f"room {self.room!r}: the stream was closed", room=self.room) from None
        if isinstance(item, LeasedChunk) and self.handle._stream is not None:
            self.handle._stream._sent_chunk(item)  # the stream releases it if it never reaches the caller

    def _holds_chunks(self, first: bool) -> bool:
        """A later round of a zero-copy stream: the caller may hold this room's chunks while it waits (only
        then is a wait worth a task that explains it)."""
        return not first and self.stream is not None and self.zero_copy

    def _pool_holders_note(self) -> str | None:
        """A first reservation gave up waiting: what holds the pool. Rooms whose senders have not started them
        (the head-of-line block of README, "Reservations and the order of requests"), rows that arrived and are
        not released yet (leases), and fenced blocks."""
        rooms, blocks = self.ctx.unstarted()
        keeper, total = self.ctx.keeper, self.ctx.pool.num_blocks
        readable = sum(len(g.blocks) for g in keeper.ledger.grants(state=GrantState.READABLE))
        fenced = keeper.allocator.stats.fenced
        said = []
        if rooms:
            said.append(f"{blocks} of the pool's {total} blocks are first reservations of {rooms} room(s) whose "
                        "sender has sent nothing yet: if their encoders are busy with rooms that wait here for memory "
                        "(an encoder that sends in another order, or fewer at once, than rooms are started here), "
                        "nothing moves until timeouts; start a room when its encoder is about to send it, or size "
                        "pool_tokens for the rooms started at once (default_tokens each)")
        if readable:
            said.append(f"{readable} of the pool's {total} blocks hold rows that arrived and are not released yet "
                        "(leases and zero-copy results not released, or copies under way): release a lease as soon "
                        "as its rows are used")
        if fenced:
            said.append(f"{fenced} of the pool's {total} blocks are fenced (a failed or aborted write may still land "
                        "there; they come back once that is ruled out)")
        return "; ".join(said) or None

    def _held_chunks_note(self) -> str | None:
        """Zero-copy stream: how much of the pool the caller holds in unreleased chunks of this room."""
        if self.stream is None or not self.zero_copy:
            return None
        held = [g for g in self.ctx.keeper.ledger.grants(state=GrantState.READABLE) if g.room == self.room]
        if not held:
            return None
        blocks = sum(len(g.blocks) for g in held)
        return (f"the caller holds {len(held)} unreleased leased chunk(s) of this room ({blocks} of the pool's "
                f"{self.ctx.pool.num_blocks} blocks): release chunks as they are consumed, or the rest of the "
                "room cannot land")

    def _make_output(self, total: int) -> dict[str, torch.Tensor]:
        if self.out is None:
            return fresh_output(self.ctx.outputs, self.ctx.layout, total, self.ctx.pool.device, self.room)
        short = short_fields(self.out, total)
        if short:
            raise TransferFailed(f"room {self.room!r}: the request has {total} tokens but out= holds only "
                                 f"{short}", room=self.room)
        return {n: t[:total] for n, t in self.out.items()}

    def _lease_views(self, kept: list[tuple[int, int]]) -> dict[str, list[torch.Tensor]]:
        views: dict[str, list[torch.Tensor]] = {name: [] for name in self.ctx.layout}
        for grant, count in kept:
            for name, vs in self.ctx.pool.views(self.ctx.keeper.blocks_of(grant), count).items():
                views[name].extend(vs)
        return views

    def _first_tokens(self) -> int:
        cfg = self.ctx.config
        want = self.expected_tokens if self.expected_tokens is not None else cfg.default_tokens
        return min(want, cfg.round_tokens, cfg.pool_tokens - cfg.resume_reserve)

    def _round_tokens(self, remaining: int, *, shrink: bool = True) -> int:
        cfg = self.ctx.config
        want = min(remaining, cfg.round_tokens)
        bs = cfg.block_size
        free_tokens = self.ctx.keeper.allocator.stats.free * bs
        if shrink and want > free_tokens:
            # The pool is short: take a smaller round now rather than wait for a big one that
            # may never come free (other blocks may be held by rooms still waiting for input).
            floor = min(want, max(cfg.resume_reserve, bs))
            want = max(floor, free_tokens // bs * bs)
        return want

    def _add_phase(self, name: str, t0: float) -> None:
        self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - t0
