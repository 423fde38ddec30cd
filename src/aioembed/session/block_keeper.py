"""The receiver's pool memory: the allocator and the ownership ledger, and the one place where the
ledger's actions (``Free``, ``Fence``) are carried out.

Rooms and connections never free or fence blocks themselves: they report events to the
:class:`~aioembed.protocol.ownership.BlockLedger` through this keeper and it applies what the
ledger decides. It also runs the ledger's timed releases, counting only time this process was
running: a late wake-up of the timer means the loop stalled, and the windows start again.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

import anyio

from aioembed.log_budget import WarningBudget
from aioembed.memory.allocator import BlockAllocator
from aioembed.metrics import TransferObserver
from aioembed.protocol.messages import RoomId
from aioembed.protocol.ownership import (
    BlockLedger,
    Fence,
    FenceReason,
    Free,
    GrantState,
    LedgerAction,
    Proof,
    Writer,
)
from aioembed.session.deadlines import DeadlineTimer
from aioembed.session.fence_log import FenceLog

__all__ = ["WAIT_NOTE_AFTER", "BlockKeeper"]

log = logging.getLogger("aioembed.session.blocks")

WAIT_NOTE_AFTER = 1.0
"""Seconds a reservation waits before its ``on_wait`` note is logged."""


class BlockKeeper:
    """Allocator + ledger of one receiver's pool."""

    def __init__(self, allocator: BlockAllocator, *, name: str, observer: TransferObserver,
                 stall_tolerance: float, watch_every: float | None = None) -> None:
        self.allocator = allocator
        self.ledger = BlockLedger()
        self.name = name
        self.observer = observer
        self.fence_log = FenceLog(log, name)
        # watch_every: see DeadlineTimer (stalls while windows run, with no live session's heartbeats to see them)
        self.timer = DeadlineTimer(self._next_deadline, self._due, self._stalled, stall_tolerance=stall_tolerance,
                                   watch_every=watch_every)
        self.fenced_total: Counter[str] = Counter()
        """Blocks ever fenced, by reason name (for metrics)."""
        self.released_total: Counter[str] = Counter()
        """Fenced blocks released, by proof name."""
        self._claims: dict[int, int] = {}  # first grant of a zero-copy room -> blocks its request needs
        self._wait_notes = WarningBudget(log)  # a burst of rooms waiting for memory would log a WARNING each

    def claim(self, grant: int, blocks: int) -> None:
        """A zero-copy room (then its lease) will hold ``blocks`` until released; ``grant`` is its first."""
        self._claims[grant] = blocks

    def unclaim(self, grant: int) -> None:
        """The zero-copy room of first grant ``grant`` ended without a lease: its claim ends now."""
        self._claims.pop(grant, None)

    @property
    def claimed_blocks(self) -> int:
        """Blocks claimed by zero-copy rooms and leases: they come back only when their users let go."""
        return sum(self._claims.values())

    # -- reserving ---------------------------------------------------------------------------

    def try_reserve(self, room: RoomId, tokens: int, *, priority: bool = False, keep_free: int = 0,
                    round: int = 0) -> int | None:
        """A grant for ``tokens`` now, or ``None`` if that would wait."""
        blocks = self.allocator.try_alloc(tokens, priority=priority, keep_free=keep_free)
        return None if blocks is None else self.ledger.reserve(room, blocks, round=round)

    async def reserve(self, room: RoomId, tokens: int, *, timeout: float, priority: bool, keep_free: int,
                      round: int = 0, on_wait: Callable[[], str | None] | None = None) -> int:
        """A grant for ``tokens``, waiting (FIFO) for free blocks; ``AllocationTimeout`` after ``timeout``.

        ``on_wait``: asked once if the wait lasts :data:`WAIT_NOTE_AFTER` seconds; what it returns is
        logged as a warning (e.g. the caller holds pool memory this room needs)."""
        if on_wait is None:
            blocks = await self.allocator.alloc(tokens, timeout=timeout, priority=priority, keep_free=keep_free)
            return self.ledger.reserve(room, blocks, round=round)

        async def note_later() -> None:
            await anyio.sleep(WAIT_NOTE_AFTER)
            note = on_wait()
            if note:
                self.wait_note(room, tokens, note)

        got: list[list[int]] = []
        failed: list[Exception] = []
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(note_later)
                try:
                    got.append(await self.allocator.alloc(tokens, timeout=timeout, priority=priority,
                                                          keep_free=keep_free))
                except Exception as exc:  # raised below, outside the task group (which would wrap it)
                    failed.append(exc)
                tg.cancel_scope.cancel()
        except BaseException:
            # Cancelled while the group ended, after the blocks were granted: no grant holds them yet, so
            # they go straight back (kept, they would be used for good with nothing to free them).
            if got:
                self.allocator.free(got[0])
            raise
        if failed:
            raise failed[0]
        return self.ledger.reserve(room, got[0], round=round)

    def wait_note(self, room: RoomId, tokens: int, note: str, *, timed_out: bool = False) -> None:
        """Log why ``room`` waits (or waited, ``timed_out``) for ``tokens`` of pool memory: one WARNING per
        :data:`~aioembed.log_budget.WINDOW` for all rooms, DEBUG lines between them."""
        self._wait_notes.warn("pool memory", "%s: room=%r: %s for %d tokens of pool memory: %s", self.name, room,
                              "gave up waiting" if timed_out else "waiting", tokens, note)

    def blocks_of(self, grant: int) -> tuple[int, ...]:
        """The block ids of a live grant."""
        return self.ledger.grant(grant).blocks

    # -- applying the ledger's decisions -------------------------------------------------------

    def apply(self, actions: Iterable[LedgerAction]) -> None:
        """Carry out ``Free`` / ``Fence`` actions on the allocator (and log fences: see :mod:`.fence_log`)."""
        changed = False
        for a in actions:
            changed = True
            if isinstance(a, Fence):
                self.allocator.fence(a.blocks)
                self.fenced_total[a.reason.name] += len(a.blocks)
                self.observer.blocks_fenced(reason=a.reason.name.lower(), blocks=len(a.blocks),
                                            sender=a.writer.address if a.writer else "")
                self.fence_log.fenced(a, anyio.current_time())
            else:
                self._free(a)
        if changed:
            self.timer.wake()

    def _free(self, a: Free) -> None:
        self.allocator.free(a.blocks)
        self._claims.pop(a.grant, None)  # a zero-copy room's first grant: its claim ends with it
        if a.was is GrantState.FENCED:
            self.released_total[a.proof.name] += len(a.blocks)
            self.observer.fence_released(proof=a.proof.name.lower(), blocks=len(a.blocks),
                                         sender=a.writer.address if a.writer else "")
            self.fence_log.released(a, anyio.current_time())
        elif a.proof not in (Proof.CONSUMED, Proof.UNANNOUNCED, Proof.STATUS):
            log.debug("%s: room=%r: %d blocks freed: %s", self.name, a.room, len(a.blocks), a.proof.value)

    # -- events that concern many grants ---------------------------------------------------------

    def fence(self, grant: int, reason: FenceReason) -> None:
        """The grant's room ended while its writer may still reach it."""
        self.apply(self.ledger.fence(grant, reason, now=anyio.current_time()))
        self.timer.wake()  # what is known about its sender may have scheduled a release

    def drained(self, sender: str, below_epoch: int, *, settle: float) -> None:
        self.apply(self.ledger.drained(sender, below_epoch, now=anyio.current_time(), settle=settle))
        self.timer.wake()  # timed releases may have been scheduled

    def revoked(self, sender: str, *, below_epoch: int) -> None:
        self.apply(self.ledger.revoked(sender, below_epoch=below_epoch))

    def writer_gone(self, sender: str, *, lifetime: float) -> None:
        self.apply(self.ledger.writer_gone(sender, now=anyio.current_time(), lifetime=lifetime))
        self.timer.wake()

    def writer_back(self, sender: str) -> None:
        self.ledger.writer_back(sender)
        self.timer.wake()

    def fence_released(self, writer: Writer, room: RoomId, *, settle: float) -> None:
        self.apply(self.ledger.fence_released(writer, room, now=anyio.current_time(), settle=settle))
        self.timer.wake()

    def late_answer(self, writer: Writer, room: RoomId, proof: Proof, *, round: int | None = None,
                    settle: float = 0.0) -> bool:
        """A writer's answer for a room no longer in flight here; True if it released something. ``settle``:
        see :meth:`BlockLedger.late_answer`."""
        actions = self.ledger.late_answer(writer, room, proof, round=round, now=anyio.current_time(),
                                          settle=settle)
        self.timer.wake()
        self.apply(actions)
        return bool(actions)

    def late_fence(self, writer: Writer, room: RoomId) -> None:
        """A late ``STATUS(fence=True)``: the blocks stay fenced until ``FENCE_RELEASE``."""
        for g in self.ledger.fenced_for(writer, room):
            self.fence(g.id, FenceReason.WRITE_FAILED)

    def stalled(self, now: float) -> None:
        """Our loop did not run for a while: timed releases start their windows again, and bursts of fence
        log lines due meanwhile are summed up (else the timer would take their past deadline for a
        second stall)."""
        self.ledger.loop_stalled(now)
        self.fence_log.flush(now)
        self.timer.wake()

    # -- the timer ---------------------------------------------------------------------------

    async def run_timers(self) -> None:
        """Free grants whose timed release came (a background task of the receiver)."""
        await self.timer.run()

    def _next_deadline(self) -> float | None:
        times = [t for t in (self.ledger.next_deadline(), self.fence_log.next_due()) if t is not None]
        return min(times, default=None)

    def _due(self, now: float) -> None:
        self.apply(self.ledger.tick(now))
        self.fence_log.flush(now)

    def close(self) -> None:
        """The receiver is closing (its timer task is gone): sum up the bursts of fence log lines still
        open; later fences are logged in full."""
        self.fence_log.close()

    def _stalled(self, now: float) -> None:
        log.warning("%s: the event loop stalled; timed releases of fenced blocks start again", self.name)
        self.stalled(now)
