"""Waiting for submitted engine transfers without a thread per transfer.

``TransferEngine.transfer_submit_write`` queues one transfer and returns its id at once;
``transfer_check_status`` says, in well under a microsecond and without blocking, whether it is
done (1), failed (-1) or timed out (-2), or still pending (0). The engine offers no completion
callback or file descriptor, so completions are polled: by one poll loop per endpoint, run by
whichever waiting task holds the baton (no background task, no thread). It sleeps between polls,
briefly after progress and longer while nothing moves, and stops as soon as nothing is pending.
A final status frees the id inside the engine, so an id is never polled again after it.

Per link, :class:`Credits` bound the transfers in flight (the engine's per-peer queue is finite),
so a stalled peer holds its own link's credits and nothing else: writes to healthy peers go on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import anyio

__all__ = ["DONE", "PENDING", "Credits", "PendingTransfer", "TransferPoller"]

_POLL_FIRST = 0.00005
_POLL_MAX = 0.002
_POLL_FRESH = 0.0003
"""Seconds after a submit or a completion during which the poll loop only yields between polls."""

DONE, PENDING = 1, 0


class PendingTransfer:
    """One submitted transfer: its engine id, and its final status once known."""

    __slots__ = ("batch", "length", "on_done", "status")

    def __init__(self, batch: int, length: int) -> None:
        self.batch = batch
        self.length = length
        self.status = PENDING
        self.on_done: Callable[[], None] | None = None
        """Called once it ends, when its writer stopped waiting for it (e.g. to return a credit)."""


class TransferPoller:
    """The poll loop of one endpoint (see the module docstring)."""

    def __init__(self, check: Callable[[int], int]) -> None:
        self._check = check
        self._pending: dict[int, PendingTransfer] = {}
        self._leading = False
        self._progress = anyio.Event()  # set (and replaced) after every poll that finished something
        self.polls = 0

    @property
    def pending(self) -> int:
        """Transfers submitted and not finished."""
        return len(self._pending)

    def add(self, transfers: Sequence[PendingTransfer]) -> None:
        for t in transfers:
            self._pending[t.batch] = t

    def _poll(self) -> bool:
        """Check every pending transfer once; True if any finished."""
        self.polls += 1
        finished = [t for t in self._pending.values() if self._finished(t)]
        for t in finished:
            del self._pending[t.batch]
        return bool(finished)

    def _finished(self, t: PendingTransfer) -> bool:
        status = int(self._check(t.batch))
        if status == PENDING:
            return False
        t.status = status
        if t.on_done is not None:
            t.on_done()
        return True

    async def wait(self, transfers: Sequence[PendingTransfer], deadline: float | None = None) -> bool:
        """Return True once every transfer has a final status, or False at ``deadline`` (the rest stay
        pending here, polled by later waiters and by :meth:`drain`). Not cancellable: the engine cannot
        cancel a transfer, so its memory may not be released before it ends or the caller gives up."""
        with anyio.CancelScope(shield=True):
            while any(t.status == PENDING for t in transfers):
                if deadline is not None and anyio.current_time() >= deadline:
                    return False
                if self._leading:
                    progress = self._progress
                    with anyio.move_on_after(None if deadline is None else deadline - anyio.current_time()):
                        await progress.wait()  # the leader polls for everyone; look again after it moved
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
            if self._poll():
                self._wake()
                delay = _POLL_FIRST
                fresh_until = time.perf_counter() + _POLL_FRESH
            else:
                delay = min(_POLL_MAX, delay * 2)
            if all(t.status != PENDING for t in mine):
                return
            if deadline is not None and anyio.current_time() >= deadline:
                return
            if time.perf_counter() < fresh_until:
                # Just after progress, transfers of small writes end within microseconds: look again on
                # the loop's next turn (other tasks run in between). A timer would sleep at least a
                # millisecond here (the selector's resolution), longer than such a transfer takes.
                await anyio.lowlevel.checkpoint()
            else:
                await anyio.sleep(delay)

    def _wake(self) -> None:
        self._progress.set()
        self._progress = anyio.Event()

    async def drain(self) -> None:
        """Poll until nothing is pending (an endpoint closing waits for its transfers this way)."""
        leftovers = list(self._pending.values())
        if leftovers:
            await self.wait(leftovers)


class Credits:
    """A FIFO counting semaphore that takes several units at once (transfers in flight on one link)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.available = total
        self._waiters: deque[tuple[int, anyio.Event]] = deque()

    async def take(self, n: int) -> int:
        """Take ``min(n, total)`` units, waiting (first come, first served) while too few are free."""
        n = min(n, self.total)
        if not self._waiters and self.available >= n:
            self.available -= n
            await anyio.lowlevel.checkpoint()
            return n
        event = anyio.Event()
        entry = (n, event)
        self._waiters.append(entry)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():
                self.give(n)  # granted just as we were cancelled: hand it on
            else:
                self._waiters.remove(entry)
                self._serve()
            raise
        return n

    def give(self, n: int) -> None:
        self.available += n
        self._serve()

    def _serve(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.available:
            n, event = self._waiters.popleft()
            self.available -= n
            event.set()
