"""Waiting for submitted engine transfers without a thread per transfer.

``TransferEngine.transfer_submit_write`` queues one transfer and returns its id at once;
``transfer_check_status`` says, in well under a microsecond and without blocking, whether it is
done (1) or failed (-1), both final, or still pending (0), or slow (-2: one of its slices is older
than ``MC_SLICE_TIMEOUT``; only RDMA slices are timed). A slow transfer is not cancelled, and a later
check says 1 or -1, so -2 counts as pending here: taken as an end, it freed the write's blocks and
its credit while the transfer could still land. The engine offers no completion callback or file
descriptor, so completions are polled: by one poll loop per endpoint, run by whichever waiting task
holds the baton (no background task, no thread). It stops as soon as nothing is pending. A final
status frees the id inside the engine (-2 does not), so an id is polled until it has one, and never
again.

When to look: a sleep on the event loop lasts at least a millisecond (the selector's resolution),
longer than a small transfer takes, while looking on every loop turn keeps a core busy. So the loop
looks on every turn only where a completion is likely: just after a submit or a completion, and
around the time a transfer is *expected* to end, which :class:`CompletionForecast` learns per size
class from the transfers seen so far. Elsewhere it sleeps, backing off from 50 us to 2 ms. Before each
of those turns it gives up the core (``sched_yield``, a microsecond when nothing else waits): the
threads that make the transfer end (the engine's, ZeroMQ's I/O threads, the peer process on a small
host) were otherwise held off until the scheduler preempted the turning loop. With 32 transfers in
flight on 2 vCPUs that raised the requests/s by 0-17 % (+7 % in the median pair) in 8 alternating pairs
of runs, on a VM running nothing else; on a host whose cores are all busy, a yield may hand the core to
another process for a scheduler slice (not measured).

What to look at: with many in flight each poll used to ask the engine about every pending transfer (52
calls per transfer with 32 in flight). A heuristic, not a property of the engine: transfers of one size
class to one peer end about in the order they were submitted (in a W3 run, 32 of one size in flight to one
peer, 50 of 6660 ended while an earlier one was still pending; the engine spreads a peer's transfers over
several TCP connections, so a small transfer behind a large one can end first, which is why the size class
is part of the key). So each transfer carries a *queue* key (peer, size class), and a poll asks about each
queue's transfers oldest first and stops at the first one still pending; what is behind it counts as
pending too (its expected-end window still counts for when to look). Every ``_SWEEP_EVERY`` a poll asks
about everything, so one that ended out of order is seen about that much later at most, and a waiter whose
deadline passed asks about its own transfers before it gives up.

Per link, :class:`Credits` bound the transfers in flight (the engine's per-peer queue is finite),
so a stalled peer holds its own link's credits and nothing else: writes to healthy peers go on.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence

import anyio

__all__ = ["DONE", "PENDING", "SLOW", "CompletionForecast", "Credits", "CreditsClosed", "PendingTransfer",
           "TransferPoller", "queue_key"]

_POLL_FIRST = 0.00005
_POLL_MAX = 0.002
_POLL_FRESH = 0.0003
"""Seconds after a submit or a completion during which the poll loop only yields between polls."""
_SPIN_LEAD = 0.0012
"""Seconds before a transfer's expected end from which the loop looks on every turn: more than one
sleep of the selector (1 ms), so a sleep never overshoots the expected end."""
_SPIN_SLACK = 0.002
"""Past its expected end, a late transfer is looked at on every turn for 2 ms more; then the loop sleeps
again (it is late: the forecast learns from it). Small transfers end either inside their submit or
0.7-1 ms after it (handed to an engine thread on an idle vCPU), and the forecast averages the two: with
less slack the late kind was seen only after the selector's 1 ms sleeps, about 1.9 ms after its submit."""
_SWEEP_EVERY = 0.001
"""Seconds between polls that ask about every pending transfer, not only the oldest pending of each queue: about
the most a transfer that ended before an earlier one of its queue waits to be seen (the sweep is the first poll
after it is due)."""

DONE, PENDING, SLOW = 1, 0, -2
"""``transfer_check_status`` results (-1 is failed, final too); ``SLOW`` is not final (see the module docstring)."""

_sched_yield = getattr(os, "sched_yield", None)  # POSIX only, as the engine is


def queue_key(peer: str, nbytes: int) -> tuple[str, int]:
    """The :attr:`PendingTransfer.queue` of a write of ``nbytes`` to ``peer``: one queue per peer and size class."""
    return peer, CompletionForecast.size_class(nbytes)


class CompletionForecast:
    """How long a transfer of a given size takes on this endpoint: an exponential average per size
    class (powers of two), learned from the transfers seen ending. Pure bookkeeping, no clock.

    A poll sees *that* a transfer ended, not when: it ended after the last poll that saw it pending
    and before the one that saw it done. A narrow interval counts by its middle; a wide one (the loop
    slept) by its start, so the forecast errs early, which costs a few idle loop turns, never late,
    which would cost latency (and would feed on itself: a late look measures a longer time). The one
    exception: a transfer behind a pending one of its queue counts as seen pending without being asked
    about, so one that ended out of order (rare) teaches a time up to a sweep late."""

    ALPHA = 0.25

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(0, nbytes).bit_length()

    def expected(self, nbytes: int) -> float | None:
        """Seconds a transfer of ``nbytes`` is expected to take, or None before one of its class ended."""
        return self._seconds.get(self.size_class(nbytes))

    def observe(self, nbytes: int, *, ended_after: float, ended_by: float) -> None:
        """A transfer of ``nbytes`` ended between ``ended_after`` and ``ended_by`` seconds after its submit."""
        ended_after = max(0.0, min(ended_after, ended_by))
        narrow = ended_by - ended_after <= max(0.0002, 0.25 * ended_by)
        seconds = (ended_after + ended_by) / 2 if narrow else ended_after
        key = self.size_class(nbytes)
        old = self._seconds.get(key)
        self._seconds[key] = seconds if old is None else old + self.ALPHA * (seconds - old)


class PendingTransfer:
    """One submitted transfer: its engine id, and its final status once known."""

    __slots__ = ("batch", "length", "on_done", "pending_at", "queue", "slow", "spin_from", "spin_until", "status",
                 "submitted")

    def __init__(self, batch: int, length: int, queue: Hashable | None = None) -> None:
        self.batch = batch
        self.length = length
        self.queue = queue
        """Transfers with the same key are taken to end in submit order (see the module docstring): a writer's
        (peer session, size class), from :func:`queue_key`. None: asked about at every poll."""
        self.status = PENDING
        self.on_done: Callable[[], None] | None = None
        """Called once it ends, when its writer stopped waiting for it (e.g. to return a credit)."""
        self.submitted = 0.0
        """``time.perf_counter()`` when the poller took it."""
        self.pending_at = 0.0
        """When a poll last saw it pending."""
        self.spin_from = self.spin_until = 0.0
        """Around its expected end: look on every loop turn within (empty before the forecast knows)."""
        self.slow = False
        """The engine reported it ``SLOW`` (past ``MC_SLICE_TIMEOUT``) at least once: for error messages."""


class TransferPoller:
    """The poll loop of one endpoint (see the module docstring)."""

    def __init__(self, check: Callable[[int], int]) -> None:
        self._check = check
        self.forecast = CompletionForecast()
        self._pending: dict[int, PendingTransfer] = {}
        self._leading = False
        self._watching = False
        self._progress = anyio.Event()  # set (and replaced) after every poll that finished something
        self._waiter_deadline = math.inf  # the earliest deadline of a waiter the leader polls for (anyio's clock)
        self._sweep_at = 0.0
        self.polls = 0

    @property
    def pending(self) -> int:
        """Transfers submitted and not finished."""
        return len(self._pending)

    def add(self, transfers: Sequence[PendingTransfer]) -> None:
        now = time.perf_counter()
        for t in transfers:
            t.submitted = t.pending_at = now
            expected = self.forecast.expected(t.length)
            if expected is not None:
                t.spin_from, t.spin_until = now + expected - _SPIN_LEAD, now + expected + _SPIN_SLACK
            self._pending[t.batch] = t

    def _poll(self, *, sweep: bool = False) -> tuple[bool, bool, float | None]:
        """Check the pending transfers once, each queue's oldest first up to the first still pending (all of them
        with ``sweep`` or when a sweep is due): (whether any finished, whether one still pending is in its
        expected-end window now, when the next such window opens)."""
        self.polls += 1
        now = time.perf_counter()
        if sweep or now >= self._sweep_at:
            sweep, self._sweep_at = True, now + _SWEEP_EVERY
        finished: list[PendingTransfer] = []
        behind: set[Hashable] = set()  # queues with a transfer seen pending in this poll
        due, opens = False, None
        for t in self._pending.values():
            queue = t.queue
            if queue is not None and queue in behind and not sweep:
                # Behind a pending one of its queue: pending too. Had it ended out of order, the forecast learns
                # from it up to a sweep late (the rare case; its docstring's "errs early" holds otherwise).
                t.pending_at = now
            elif self._finished(t, now):
                finished.append(t)
                continue
            elif queue is not None:
                behind.add(queue)
            # Every pending transfer's window counts, looked at or not: a late head is about to end, and those
            # behind it in their windows say so (with the heads' windows only, the loop could sleep through them).
            if t.spin_from <= now < t.spin_until:
                due = True
            elif now < t.spin_from and (opens is None or t.spin_from < opens):
                opens = t.spin_from
        for t in finished:
            del self._pending[t.batch]
        return bool(finished), due, opens

    def _finished(self, t: PendingTransfer, now: float) -> bool:
        status = int(self._check(t.batch))
        if status in (PENDING, SLOW):  # SLOW: still in flight, and its id still held by the engine
            t.pending_at = now
            if status == SLOW:
                t.slow = True
            return False
        t.status = status
        if status == DONE:
            self.forecast.observe(t.length, ended_after=t.pending_at - t.submitted, ended_by=now - t.submitted)
        if t.on_done is not None:
            t.on_done()
        return True

    async def watch(self, until: Callable[[], bool], *, max_delay: float = _POLL_MAX) -> None:
        """Until ``until()``: see that transfers nobody waits for are polled now and then. For callers that
        wait on what ending transfers give back (a link's credits, the end of a failed write's leftovers)
        and hold no transfer of their own to lead for: without them, transfers a writer gave up on were
        polled only while another write waited. One watcher polls at a time, and none while a waiter
        leads (it polls for everyone); the others look again after each poll that ended something, or
        every ``max_delay``. Cancellable."""
        delay = _POLL_FIRST
        while not until():
            if self._watching or self._leading or not self._pending:
                progress = self._progress
                with anyio.move_on_after(max_delay):
                    await progress.wait()
                continue
            self._watching = True
            try:
                while not until() and self._pending and not self._leading:
                    moved, _, _ = self._poll()
                    if moved:
                        self._wake()
                        delay = _POLL_FIRST
                        continue
                    await anyio.sleep(delay)
                    delay = min(max_delay, delay * 2)
            finally:
                self._watching = False
                self._wake()  # another watcher takes over if its wait goes on

    async def wait(self, transfers: Sequence[PendingTransfer], deadline: float | None = None) -> bool:
        """Return True once every transfer has a final status, or False at ``deadline`` (the rest stay
        pending here, polled by later waiters, :meth:`watch` and :meth:`drain`). Not cancellable: the engine
        cannot cancel a transfer, so its memory may not be released before it ends or the caller gives up.

        A waiter behind the leader has no timer: the leader's loop wakes it at its deadline, up to one of the
        loop's sleeps late (2 ms at most: the leader may be asleep when the waiter says its deadline)."""
        with anyio.CancelScope(shield=True):
            while any(t.status == PENDING for t in transfers):
                if deadline is not None and anyio.current_time() >= deadline:
                    self.poll_now()  # polls skip what is behind a pending transfer of its queue: ask about all once
                    return all(t.status != PENDING for t in transfers)
                if self._leading:
                    # The leader polls for everyone and wakes the waiters after each poll that ended something,
                    # and at the earliest waiter's deadline (not a timer per waiter: one per write was made and
                    # cancelled, and stayed in the loop's heap until cleaned).
                    if deadline is not None:
                        self._waiter_deadline = min(self._waiter_deadline, deadline)
                    await self._progress.wait()
                    continue
                self._leading = True
                try:
                    await self._lead(transfers, deadline)
                finally:
                    self._leading = False
                    self._wake()  # another waiter takes the baton if anything is still pending
        return True

    async def _lead(self, mine: Sequence[PendingTransfer], deadline: float | None) -> None:
        delay = _POLL_FIRST
        fresh_until = time.perf_counter() + _POLL_FRESH
        while True:
            moved, due, opens = self._poll()
            if moved:
                self._wake()
                delay = _POLL_FIRST
                fresh_until = time.perf_counter() + _POLL_FRESH
            if all(t.status != PENDING for t in mine):
                return
            if deadline is not None or self._waiter_deadline != math.inf:
                clock = anyio.current_time()
                if deadline is not None and clock >= deadline:
                    return
                if clock >= self._waiter_deadline:
                    self._wake()  # a waiter's deadline passed: it looks at its transfers and gives up
            now = time.perf_counter()
            if due or now < fresh_until:
                # A completion is likely within microseconds: look again on the loop's next turn (other
                # tasks run in between). A timer would sleep at least a millisecond here. First the core goes to
                # any thread ready to run (see the module docstring).
                if _sched_yield is not None:
                    _sched_yield()
                await anyio.lowlevel.checkpoint()
                continue
            sleep = delay if opens is None else max(0.0, min(delay, opens - now))
            if self._waiter_deadline != math.inf:
                sleep = max(0.0, min(sleep, self._waiter_deadline - anyio.current_time()))
            await anyio.sleep(sleep)
            delay = min(_POLL_MAX, delay * 2)  # the back-off grows with sleeps only, not with loop turns

    def poll_now(self) -> None:
        """Check every pending transfer once, now: those seen ending give back what they hold. For a caller that
        wants the books current while nothing else polls (an idle endpoint is polled by its next write)."""
        if self._pending and self._poll(sweep=True)[0]:
            self._wake()

    def _wake(self) -> None:
        self._progress.set()
        self._progress = anyio.Event()
        self._waiter_deadline = math.inf  # every waiter looks again, and says its deadline again if it waits on

    def close(self) -> None:
        """Let go of the engine (``check`` is its bound method, which keeps it alive): once the endpoint drained
        every transfer, so that its close destroys the engine then, not whenever the endpoint is collected."""
        if self._pending:
            raise RuntimeError(f"closing a poller with {len(self._pending)} transfers pending")
        self._check = _closed

    def forget(self, transfers: Collection[PendingTransfer]) -> None:
        """Stop polling ``transfers`` (their engine ids are never freed): for an endpoint closing without waiting
        for transfers whose end matters to nobody, which its engine's destruction ends."""
        for t in transfers:
            self._pending.pop(t.batch, None)

    async def drain(self, skip: Collection[PendingTransfer] = ()) -> None:
        """Poll until nothing is pending but ``skip`` (an endpoint closing waits for its transfers this way)."""
        leftovers = [t for t in self._pending.values() if t not in skip]
        if leftovers:
            await self.wait(leftovers)


def _closed(batch: int) -> int:
    raise RuntimeError(f"engine transfer {batch} polled after its endpoint closed")


class CreditsClosed(Exception):
    """The link closed while a write waited for its credits."""


class _Waiter:
    __slots__ = ("event", "granted", "n")

    def __init__(self, n: int) -> None:
        self.n = n
        self.event = anyio.Event()
        self.granted = False


class Credits:
    """A FIFO counting semaphore that takes several units at once (transfers in flight on one link)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.available = total
        self.closed = False
        self._waiters: deque[_Waiter] = deque()

    def take_now(self, n: int) -> int | None:
        """Take ``min(n, total)`` units if they are free now (as :meth:`take` would without waiting); ``None``
        if :meth:`take` would wait or raise. Not a checkpoint: the hot path of a write takes its credits here,
        and the write's wait for its transfers is where it yields."""
        n = min(n, self.total)
        if self.closed or self._waiters or self.available < n:
            return None
        self.available -= n
        return n

    async def take(self, n: int) -> int:
        """Take ``min(n, total)`` units, waiting (first come, first served) while too few are free.
        Cancellation-safe: a cancelled take holds nothing. Raises :class:`CreditsClosed` once closed."""
        n = min(n, self.total)
        await anyio.lowlevel.checkpoint_if_cancelled()  # before taking: a cancellation here holds nothing
        if self.closed:
            raise CreditsClosed
        if not self._waiters and self.available >= n:
            self.available -= n
            await anyio.lowlevel.cancel_shielded_checkpoint()  # taken: no cancellation may lose them now
            return n
        waiter = _Waiter(n)
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.give(n)  # granted just as we were cancelled: hand it on
            elif not waiter.event.is_set():
                self._waiters.remove(waiter)
                self._serve()
            raise
        if not waiter.granted:
            raise CreditsClosed
        return n

    def give(self, n: int) -> None:
        self.available += n
        self._serve()

    def close(self) -> None:
        """Wake every waiter with :class:`CreditsClosed`; later takes raise it too."""
        self.closed = True
        while self._waiters:
            self._waiters.popleft().event.set()

    def _serve(self) -> None:
        while self._waiters and self._waiters[0].n <= self.available:
            waiter = self._waiters.popleft()
            self.available -= waiter.n
            waiter.granted = True
            waiter.event.set()
