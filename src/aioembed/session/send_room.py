"""One room on the sender: per-rank reservations, the writes, and the final frames it owes.

Ranks progress independently; a rank is written as soon as it holds a reservation and the input
is there, and its next round as soon as that round's early RESUME is in hand, alongside the round
before it (whose STATUS still goes first). The room never tells a receiver that its blocks are
quiet while a write into them may still land: the
:class:`~aioembed.protocol.ownership.WriteLedger` says when it may (an ``ABORT_ACK`` or a
non-fence final ``STATUS`` only once the room's writes ended; after a write that may still land,
``STATUS(fence=True)`` and, later, ``FENCE_RELEASE``).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import torch

from aioembed.config import TransferConfig
from aioembed.errors import (
    AioembedError,
    PeerDead,
    TransferAborted,
    TransferError,
    TransferFailed,
    TransferTimeout,
    TransportError,
)
from aioembed.layout import Layout
from aioembed.memory.plan import FieldSpan, plan_inline, plan_row_runs, plan_writes
from aioembed.metrics import TransferObserver
from aioembed.protocol.messages import AbortAck, Message, RoomId, Status, TransferStatus, plain_text
from aioembed.protocol.ownership import WriteLedger, WriteOutcome, WriterAction
from aioembed.protocol.room import RankPhase, SenderRoomState, WriteTask
from aioembed.session.peer_sessions import PeerSession
from aioembed.session.room_deadlines import RoomDeadlines
from aioembed.transports.base import WriteOp
from aioembed.transports.boundary import GuardedTransport

__all__ = ["CHUNK_WRITES_IN_FLIGHT", "SendContext", "SendRoomDriver"]

log = logging.getLogger("aioembed.session.sender")

CHUNK_WRITES_IN_FLIGHT = 2
"""Chunk writes of one round posted at once: the next chunk is on the link while the last one's completion
is noticed and announced (one at a time, each chunk would leave the link idle for that long)."""


@dataclass(frozen=True, slots=True)
class SendContext:
    """What every room of one sender shares."""

    config: TransferConfig
    layout: Layout
    ledger: WriteLedger
    transport: GuardedTransport
    observer: TransferObserver
    send: Callable[[PeerSession, Message], bool]
    """Queue a frame; False (logged) if it could not be encoded or queued."""
    apply: Callable[[list[WriterAction]], None]
    last_refusal: Callable[[], str | None]
    """Why the last handshake with a receiver failed, if one did (named when a room times out)."""
    spawn: Callable[..., object]
    """Start a task owned by the sender (cancelled when it closes)."""
    deadlines: RoomDeadlines
    """Every room's deadlines (the room's, and each wait's), kept by one task of the sender's."""


class SendRoomDriver:
    """The sender's driver of one room."""

    def __init__(self, room: RoomId, ctx: SendContext, now: float) -> None:
        self.ctx = ctx
        self.machine = SenderRoomState(room, block_size=ctx.config.block_size)
        self.rank_peer: dict[int, PeerSession] = {}
        self.wake = anyio.Event()
        self.active = False
        """True while a ``send()`` drives the room."""
        self.sources: list[torch.Tensor] = []
        self.source = 0
        self.metadata: dict[str, Any] | None = None
        self.created = now
        self.status_sent_at: dict[int, float] = {}
        self.abort_from: set[int] = set()
        self.finished: set[int] = set()
        """Ranks already told that the room is over."""
        self.ended_by_receivers: set[str] = set()
        """Receivers (ids) whose ABORT or REJECT ended the room."""
        self._scope: anyio.CancelScope | None = None
        """While :meth:`drive` runs: its scope, which the room's hard deadline cancels (``ctx.deadlines``)."""
        self._watching: set[anyio.Event] = set()
        """Writes waiting for the next round's early RESUME (:meth:`_go_ahead`), woken by :meth:`poke`."""

    @property
    def room(self) -> RoomId:
        return self.machine.room

    def poke(self) -> None:
        """Wake the driver: the room's state changed."""
        self.wake.set()
        self._wake_watchers()

    def _wake_watchers(self) -> None:
        for event in self._watching:
            event.set()

    def stop(self, reason: str) -> None:
        """End the room now, writes in flight included (the sender is closing and its grace ran out): they are
        cancelled, and a write that may still land is fenced at its rank, as for any failed write."""
        self.machine.fail(reason, aborted=True)
        if self._scope is not None:
            self._scope.cancel()
        self.poke()

    def take_input(self, sources: list[torch.Tensor], source: int, metadata: dict[str, Any], now: float) -> None:
        """``send()`` is driving the room from ``sources``."""
        self.active = True
        self.created = now
        self.sources = sources
        self.source = source
        self.metadata = metadata

    # -- driving -------------------------------------------------------------------------------

    def next_deadline(self) -> tuple[float, str]:
        """The earliest deadline of the room and its phase name."""
        cfg, m = self.ctx.config, self.machine
        best = (self.created + cfg.room_timeout, "room")
        if m.expected_ranks is None or len(m.ranks) < m.expected_ranks:
            best = min(best, (self.created + cfg.input_timeout, "init"))
        # The receiver knows why a round is late (it waits for pool memory): it gets to time out and say
        # so first, so the sender waits a little longer for its RESUME than the receiver waits.
        resume_wait = cfg.round_timeout + max(1.0, cfg.heartbeat_interval)
        for rank, p in m.ranks.items():
            if p.phase is RankPhase.AWAITING_RESUME:
                best = min(best, (self.status_sent_at.get(rank, self.created) + resume_wait, "resume"))
        return best

    async def drive(self) -> None:
        """Write every rank's rounds until the room ends; raises its ``TransferError`` unless it succeeded."""
        m, room = self.machine, self.room
        error: TransferError | None = None
        # room_timeout bounds the whole room, a write that never ends included (it is cancelled; one that may
        # still land is fenced at its rank): the loop below looks at deadlines only between writes.
        self._scope = anyio.CancelScope()
        deadlines = self.ctx.deadlines
        deadlines.set(self, self.created + self.ctx.config.room_timeout, self._scope.cancel)
        try:
            with self._scope:
                # One rank (the usual case) is written from this task. Only once several ranks are to be
                # written at the same time is a task group made for them: one costs about as much as a
                # small room's planning, for nothing when there is one rank. (A room of several rounds has
                # one per rank's write anyway, for the rounds written ahead: see write().)
                ended, error = await self._drive_ranks(None)
                if not ended:
                    async with anyio.create_task_group() as tg:
                        _, error = await self._drive_ranks(tg)
            if self._scope.cancelled_caught and not m.state.terminal:
                error = self._timed_out("room")
                m.fail(str(error))
        finally:
            deadlines.drop(self)
            self._scope = None
            # Every write of this room is over here (the task group has exited, or the one write was
            # awaited), so telling the ranks that the room ended is safe: they may free their blocks,
            # unless a write may still land.
            if not m.state.terminal:
                m.fail("send() was cancelled", aborted=True)
            self.notify_end()
        if m.state is TransferStatus.SUCCESS:
            log.debug("sender: room=%r: done, %d tokens to %d ranks", room, m.total, m.expected_ranks)
            return
        raise error if error is not None else self._failure()

    async def _drive_ranks(self, tg: anyio.abc.TaskGroup | None) -> tuple[bool, TransferTimeout | None]:
        """Write the ranks' rounds as they become ready, until the room ends: ``(True, the error of a deadline
        that passed, if one did)``. Without a task group ``tg``, returns ``(False, None)`` (nothing started)
        as soon as several ranks are to be written at the same time."""
        m = self.machine
        while True:
            ready = m.ready_ranks()
            if len(ready) == 1 and m.expected_ranks == 1:
                await self.write(m.start_write(ready[0]))  # one rank: written from this task
            elif ready:
                if tg is None:
                    return False, None
                for rank in ready:  # several ranks are written at the same time
                    tg.start_soon(self.write, m.start_write(rank))
            if m.state.terminal:
                return True, None
            deadline, phase = self.next_deadline()
            wake = self.wake
            self.ctx.deadlines.set(wake, deadline, wake.set)  # the room's own deadline is keyed by this driver
            try:
                await wake.wait()
            finally:
                self.ctx.deadlines.drop(wake)
            self.wake = anyio.Event()
            if not m.state.terminal and anyio.current_time() >= deadline:
                error = self._timed_out(phase)
                m.fail(str(error))
                return True, error

    def _failure(self) -> TransferError:
        """The error of a room that failed without a deadline passing. ``PeerDead`` only if the room failed
        because a rank's receiver was lost (``machine.peer_lost``): a rank whose session ended after the room had
        failed for another reason (a write to another rank, a refused frame) is not its cause."""
        m, room = self.machine, self.room
        reason = m.error or "failed"
        if m.state is TransferStatus.ABORTED:
            return TransferAborted(f"room {room!r}: aborted: {reason}", room=room)
        if m.peer_lost:
            return PeerDead(f"room {room!r}: {reason}", room=room)
        return TransferFailed(f"room {room!r}: {reason}", room=room)

    def _timed_out(self, phase: str) -> TransferTimeout:
        m = self.machine
        late = [f"rank {rank} ({self.rank_peer[rank]})" for rank, p in sorted(m.ranks.items())
                if p.phase is RankPhase.AWAITING_RESUME and rank in self.rank_peer]
        waiting = {
            "init": f"INIT from {m.expected_ranks or 'any'} rank(s), got {sorted(m.ranks)}",
            "resume": f"a RESUME from {', '.join(late) or 'a rank'}",
            "room": "the whole room (room_timeout)",
        }[phase]
        refusal = self.ctx.last_refusal() if phase == "init" else None
        why = f"; the last handshake with a receiver failed: {refusal}" if refusal else ""
        return TransferTimeout(f"room {self.room!r}: timed out in phase {phase!r} waiting for {waiting}{why}",
                               room=self.room, phase=phase)

    async def write(self, task: WriteTask) -> None:
        """One round to one rank; STATUS once every byte is visible there. If a round follows and its RESUME
        comes early, that round is written too, alongside (one round ahead at most), and so on: the rank's
        rounds written ahead are siblings in one task group, so a room of many rounds nests no deeper than one
        of two (cancelling nested scopes recurses once per level)."""
        if not self.machine.may_follow(task):
            await self._write_round(task, self.rank_peer[task.rank], None, anyio.Event())
            return
        async with anyio.create_task_group() as tg:
            self._start_round(tg, task, None)

    def _start_round(self, tg: anyio.abc.TaskGroup, task: WriteTask, after: anyio.Event | None) -> None:
        """Write ``task`` in ``tg`` (its STATUS once ``after``, if given, is set), with a watcher for the round
        after it while it is in flight."""
        announced = anyio.Event()
        if self.machine.may_follow(task):
            tg.start_soon(self._go_ahead, task.rank, announced, tg)
        tg.start_soon(self._write_round, task, self.rank_peer[task.rank], after, announced)

    async def _go_ahead(self, rank: int, announced: anyio.Event, tg: anyio.abc.TaskGroup) -> None:
        """Until the round in flight was announced (``announced``): start the rank's next round in ``tg`` as soon as
        its early RESUME is in hand. The two writes then share the link, and their STATUS frames still go in order.
        Once the round was announced, the next round is no longer this watcher's to start (its write follows as
        for any round in hand, or goes ahead of the next one's): woken then, it ends."""
        while not announced.is_set():
            if rank in self.machine.ahead_ranks():
                self._start_round(tg, self.machine.start_ahead(rank), announced)
                return
            woken = anyio.Event()
            self._watching.add(woken)
            try:
                await woken.wait()
            finally:
                self._watching.discard(woken)

    async def _write_round(self, task: WriteTask, peer: PeerSession, after: anyio.Event | None,
                           announced: anyio.Event) -> None:
        """One round, its STATUS after ``after`` (the round before it, if written ahead); ``announced`` is set
        once its STATUS went out or never will (and its watcher woken, to end)."""
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()  # started just as the room was cancelled: post nothing
            if self._may_write(task, peer):
                await self._post_round(task, peer, after)
        except Exception as exc:
            # A bug of ours (the room's own machine refusing a step of its driver, say). Raised before the write
            # was posted or once the ledger had its outcome (_post_round catches what the write raises), so the
            # room fails as for any failure, not the task group of the rank's rounds.
            log.exception("sender: room=%r: round %d to %s failed inside aioembed", self.room, task.round, peer)
            self.machine.fail(f"internal error in round {task.round} to {peer}: {type(exc).__name__}: {exc}")
            self.poke()
        finally:
            announced.set()
            self._wake_watchers()

    async def _post_round(self, task: WriteTask, peer: PeerSession, after: anyio.Event | None) -> None:
        ctx, room = self.ctx, self.room
        inline = self._inline_fields(task, peer)
        chunks = self._chunks(task, peer, inline)
        ops = [op for _, chunk_ops in chunks for op in chunk_ops]
        wid = ctx.ledger.started(peer.key, room, self.source)
        cancel_safe = ctx.transport.capabilities.cancel_safe_writes
        outcome = WriteOutcome.FAILED_CLEANLY if cancel_safe else WriteOutcome.POISONED
        settled: Callable[[], Awaitable[None]] | None = None
        t0 = time.perf_counter()
        try:
            if len(chunks) == 1:
                await peer.link.write(ops)
            else:
                await self._write_chunks(task, peer, chunks, after)
            outcome = WriteOutcome.LANDED
        except TransportError as exc:
            may_land = exc.may_land if exc.may_land is not None else not cancel_safe
            outcome = WriteOutcome.POISONED if may_land else WriteOutcome.FAILED_CLEANLY
            settled = exc.settled if may_land else None
            log.warning("sender: room=%r: write of %d tokens to %s failed%s: %s", room, task.count, peer,
                        " (it may still land: fenced)" if may_land else "", exc)
            self.machine.fail(f"write of {task.count} tokens ({sum(o.length for o in ops)} bytes) to {peer} "
                              f"failed: {exc}")
            self.poke()
            return
        except Exception as exc:  # not the plugin's (the boundary maps those): a bug of ours; fence it
            outcome = WriteOutcome.POISONED
            log.exception("sender: room=%r: write to %s failed unexpectedly", room, peer)
            self.machine.fail(f"write of {task.count} tokens to {peer} failed: {type(exc).__name__}: {exc}")
            self.poke()
            return
        finally:
            ended_at = anyio.current_time()
            ctx.apply(ctx.ledger.ended(wid, outcome, now=ended_at, lifetime=ctx.transport.write_lifetime,
                                       settling=settled is not None))
            if settled is not None:
                ctx.spawn(self._settle, wid, settled)
        ctx.observer.round_finished(side="sender", seconds=time.perf_counter() - t0)
        if after is not None:
            await after.wait()  # a round written ahead: the STATUS of the round before it goes first
            ended_at = anyio.current_time()  # its STATUS goes out now: the RESUME wait counts from here
        if self.machine.failed is not None or not peer.alive:
            self.poke()
            return
        status = self.machine.write_done(task, metadata=self.metadata, inline=self._inline_rows(task, inline))
        if not ctx.send(peer, status):
            # The rank never learns that its rows arrived: the room fails, and it is told so.
            self.machine.fail(f"the STATUS of round {task.round} could not be sent to {peer}",
                              even_if_complete=True)
            self.poke()
            return
        self._status_sent(status, task.rank, ended_at)
        log.debug("sender: room=%r: round %d to rank %d: %d tokens (%d ops)", room, task.round, task.rank,
                  task.count, len(ops))
        self.poke()

    def _status_sent(self, status: Status, rank: int, at: float) -> None:
        """A round's STATUS went out to ``rank`` at ``at`` (the RESUME wait counts from there)."""
        if status.inline:
            self.ctx.observer.rows_inline(side="sender", nbytes=sum(len(data) for _, data in status.inline))
        if status.state is TransferStatus.SUCCESS:
            self.finished.add(rank)
        self.status_sent_at[rank] = at

    def _may_write(self, task: WriteTask, peer: PeerSession) -> bool:
        """False if the room ended (a write started as a task may find it so: an ABORT or a refused frame came
        meanwhile), or failed now because ``peer`` is gone: a sender never posts a write to a receiver it
        dropped. Else, as round 0 of a room longer than it starts, the rank's TOTAL goes out, so that the rank
        can announce round 1 before round 0 ends (which is then written at once)."""
        if self.machine.failed is not None:
            return False
        if not peer.alive or not self.ctx.ledger.is_open(peer.key):
            self.machine.fail(f"{peer} is gone", peer_lost=True)
            self.poke()
            return False
        total = self.machine.total_for(task)
        if total is not None and not self.ctx.send(peer, total):
            # Only a head start lost: the rank reserves the next round after this one's STATUS instead.
            log.debug("sender: room=%r: the TOTAL for %s could not be queued", self.room, peer)
        return True

    async def _settle(self, wid: int, settled: Callable[[], Awaitable[None]]) -> None:
        """Until the transport saw the last of failed write ``wid`` end; then its blocks are released after
        ``orphan_lifetime`` (what the peer had buffered). If the wait fails the write stays in flight: its
        blocks stay fenced until the receiver learns otherwise (a new session, the sender gone)."""
        ctx = self.ctx
        try:
            await settled()
        except Exception:
            log.exception("sender: room=%r: waiting for a failed write's transfers to end failed; its blocks "
                          "stay fenced", self.room)
            return
        ctx.apply(ctx.ledger.settled(wid, now=anyio.current_time(), margin=ctx.transport.orphan_lifetime))

    async def _write_chunks(self, task: WriteTask, peer: PeerSession, chunks: list[tuple[int | None, list[WriteOp]]],
                            after: anyio.Event | None) -> None:
        """Write a round chunk by chunk, up to :data:`CHUNK_WRITES_IN_FLIGHT` at once (so the link never waits
        for a chunk's completion to be noticed), and announce each chunk, in order, once it landed (for a round
        written ahead, not before the round before it was announced: ``after``). One loop posts and announces,
        so no chunk is posted once a chunk failed or the room ended. Returns once every chunk posted has ended
        (none is left in flight); raises the first chunk's failure."""
        ended = [anyio.Event() for _ in chunks]
        failed: list[Exception | None] = [None] * len(chunks)
        any_failed = False  # (a round may have a thousand chunks: not a scan of ``failed`` per chunk posted)

        async def write_one(i: int) -> None:
            nonlocal any_failed
            try:
                await peer.link.write(chunks[i][1])
            except Exception as exc:  # kept for the caller, in chunk order: the other writes go on to their end
                failed[i] = exc
                any_failed = True
            finally:
                ended[i].set()

        async def settled(i: int) -> bool:
            """Chunk ``i`` ended: True if it landed and was announced (the round goes on)."""
            await ended[i].wait()
            if after is not None:
                await after.wait()
            upto = chunks[i][0]
            return failed[i] is None and (upto is None or self._announce_progress(task, peer, upto))

        async with anyio.create_task_group() as tg:
            oldest = 0  # the first chunk posted and not yet settled
            for i in range(len(chunks)):
                if i - oldest == CHUNK_WRITES_IN_FLIGHT:
                    if not await settled(oldest):
                        break
                    oldest += 1
                if self.machine.failed is not None or not peer.alive or any_failed:
                    break  # the room ended (an ABORT, the peer declared dead) or a chunk failed: nothing more goes
                tg.start_soon(write_one, i)
            else:
                while oldest < len(chunks) and await settled(oldest):
                    oldest += 1
        first = next((exc for exc in failed if exc is not None), None)
        if first is not None:
            raise _one_failure([exc for exc in failed if exc is not None])

    def _inline_fields(self, task: WriteTask, peer: PeerSession) -> tuple[int, ...]:
        """The fields of ``task`` whose rows go in its STATUS, not in a write (:func:`plan_inline`): where the
        rank takes rows inline and the round is announced only by its STATUS (no ``PROGRESS`` within it)."""
        if not peer.status_inline_bytes or self.machine.progress_points(task):
            return ()
        return _plan_inline(tuple(task.count * f.row_bytes if t.is_cpu else None
                                  for t, f in zip(self.sources, self.ctx.layout.values(), strict=True)),
                            peer.status_inline_bytes)

    def _inline_rows(self, task: WriteTask, fields: tuple[int, ...]) -> tuple[tuple[int, bytes], ...]:
        """The rows of ``task`` of ``fields``, packed, for its STATUS. Read from the caller's tensors (or their
        staged copy) as the STATUS goes out: ``send()`` holds them, unchanged, until it returns."""
        # Read unchecked by any transport, and sent to the peer: the round's rows lie inside the request because
        # _chunks, which planned this round's writes first, refused any that do not.
        return tuple((i, ctypes.string_at(t.data_ptr() + task.start * f.row_bytes, task.count * f.row_bytes))
                     for i, (t, f) in enumerate(zip(self.sources, self.ctx.layout.values(), strict=True))
                     if i in fields)

    def _chunks(self, task: WriteTask, peer: PeerSession,
                inline: tuple[int, ...]) -> list[tuple[int | None, list[WriteOp]]]:
        """The write ops of ``task`` (but for the fields carried ``inline``), cut where the rank asked for
        ``PROGRESS`` (block-aligned within the round): ``(token the chunk ends at, ops)``, the last chunk with
        ``None`` (its STATUS follows)."""
        ctx = self.ctx
        bs = ctx.config.block_size
        spans = [FieldSpan(src_base=t.data_ptr(), dst_base=reg[0], row_bytes=f.row_bytes)
                 for i, (t, reg, f) in enumerate(zip(self.sources, peer.regions, ctx.layout.values(), strict=True))
                 if i not in inline]
        bounds = [task.start, *self.machine.progress_points(task), task.start + task.count]
        rows = min(t.shape[0] for t in self.sources)
        out: list[tuple[int | None, list[WriteOp]]] = []
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            runs = plan_row_runs(num_tokens=b - a, block_size=bs, dst_blocks=task.blocks[(a - task.start) // bs:],
                                 src_start=a)
            for r in runs:
                # The transport may not check sources (reads_unregistered): a bad plan must not read past the
                # caller's rows, whatever it would send.
                if r.src_row < 0 or r.src_row + r.count > rows:
                    raise AioembedError(f"room {self.room!r}: round {task.round} planned source rows "
                                        f"[{r.src_row}, {r.src_row + r.count}) outside the request's {rows} rows")
            out.append((b if i < len(bounds) - 2 else None, plan_writes(runs, spans)))
        return out

    def _announce_progress(self, task: WriteTask, peer: PeerSession, upto: int) -> bool:
        """Rows up to ``upto`` are visible at the rank: tell it (PROGRESS). False if the room ended meanwhile
        (the rest of the round is not written)."""
        if self.machine.failed is not None or not peer.alive:
            return False
        if not self.ctx.send(peer, self.machine.write_progress(task, upto, metadata=self.metadata)):
            self.machine.fail(f"the PROGRESS of round {task.round} could not be sent to {peer}")
            return False
        return True

    def notify_end(self) -> None:
        """Tell every rank still holding a reservation that the room is over (no write of it in flight)."""
        ctx, m = self.ctx, self.machine
        for rank, peer in self.rank_peer.items():
            if rank in self.finished or not peer.alive or not ctx.ledger.is_open(peer.key):
                continue
            self.finished.add(rank)
            error = plain_text(m.error or "failed")
            if ctx.ledger.in_flight(peer.key, self.room):
                # No ABORT_ACK: a failed write may still land (a poisoned one, or one whose end the ledger never
                # heard of, which can only be a bug of ours: fenced, not trusted). FENCE_RELEASE follows once it
                # cannot land.
                ctx.send(peer, Status(room=self.room, state=TransferStatus.FAILED, total_tokens=m.total or 0,
                                      sent_tokens=0, round=0, error=error, fence=True))
                ctx.apply(ctx.ledger.fence_told(peer.key, self.room))
            elif rank in self.abort_from:
                ctx.send(peer, AbortAck(room=self.room))
            elif m.state is not TransferStatus.SUCCESS:
                state = TransferStatus.ABORTED if m.state is TransferStatus.ABORTED else TransferStatus.FAILED
                ctx.send(peer, Status(room=self.room, state=state, total_tokens=m.total or 0, sent_tokens=0,
                                      round=0, error=error))


_plan_inline = functools.lru_cache(maxsize=1024)(plan_inline)
"""Rounds of one size to one receiver are planned alike: 0.06 us a look-up against 0.9 us a plan (3 fields)."""


def _one_failure(errors: list[Exception]) -> Exception:
    """One failure for a round whose chunk writes failed: the first, but landing if any chunk may land (the
    first may have failed cleanly while a later one may still land), and settling once every chunk that can
    say when it ended did."""
    first = errors[0]
    if len(errors) == 1:
        return first
    for exc in errors:
        if not isinstance(exc, TransportError):
            return exc  # not the plugin's: a bug of ours, fenced as such
    transport_errors = [e for e in errors if isinstance(e, TransportError)]
    landing = [e for e in transport_errors if e.may_land is not False]
    may_land: bool | None = False
    if any(e.may_land for e in landing):
        may_land = True
    elif landing:
        may_land = None  # as the transport's capabilities say
    # Wait for every chunk that can say when it ended; the others are bounded by the write lifetime, which
    # the ledger keeps as the floor of any settling (counted from the round's end, after their failures).
    waits = [e.settled for e in landing if e.settled is not None]
    settled: Callable[[], Awaitable[None]] | None = None
    if waits:
        async def all_settled() -> None:
            for wait in waits:
                await wait()

        settled = all_settled
    combined = TransportError(f"{first} (and {len(errors) - 1} more chunk write(s) of the round failed)",
                              may_land=may_land, settled=settled)
    combined.__cause__ = first
    return combined
