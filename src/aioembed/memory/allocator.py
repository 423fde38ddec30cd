"""Coroutine-safe allocator of fixed-size blocks of a pool.

The language side must reserve memory before it knows a request's length, and must wait
(not fail) when the pool is short: a burst of large requests should queue, not error.
Waiters are served strictly first-in first-out so a large request cannot be starved by a
stream of small ones.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import anyio

from aioembed.errors import AllocationTimeout, AllocatorError

__all__ = ["AllocatorStats", "BlockAllocator"]

_FREE, _USED, _FENCED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """A snapshot of an allocator's accounting."""

    total: int
    """Blocks in the pool."""
    free: int
    """Blocks available now."""
    used: int
    """Blocks handed out (including fenced ones)."""
    fenced: int
    """Used blocks a peer might still write into; they are freed once that is ruled out."""
    waiters: int
    """Coroutines waiting for blocks."""
    high_water: int
    """Most blocks ever in use at once."""
    waited: int = 0
    """Allocations so far that had to wait for frees."""


class _Waiter:
    __slots__ = ("blocks", "event", "granted", "keep_free")

    def __init__(self, blocks: int, keep_free: int) -> None:
        self.blocks = blocks
        self.keep_free = keep_free
        self.event = anyio.Event()
        self.granted: list[int] | None = None


class BlockAllocator:
    """Hands out lists of block ids (not necessarily contiguous) from ``num_blocks`` blocks.

    ``alloc`` is O(blocks taken) and ``free`` is O(blocks freed) plus the waiters it serves.
    All methods are meant to be called from one event loop thread (coroutine-safe, not
    thread-safe).
    """

    def __init__(self, *, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise AllocatorError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise AllocatorError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Lowest ids are handed out first (pop from the end of a reversed stack).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._state = bytearray(num_blocks)
        self._fenced = 0
        self._waiters: deque[_Waiter] = deque()
        self._priority: deque[_Waiter] = deque()
        self._high_water = 0
        self._waited = 0
        self._all_free: anyio.Event | None = None

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return math.ceil(num_tokens / self.block_size)

    @property
    def stats(self) -> AllocatorStats:
        """Current accounting snapshot."""
        free = len(self._free)
        return AllocatorStats(
            total=self.num_blocks,
            free=free,
            used=self.num_blocks - free,
            fenced=self._fenced,
            waiters=len(self._waiters) + len(self._priority),
            high_water=self._high_water,
            waited=self._waited,
        )

    def _check_request(self, num_tokens: int) -> int:
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise AllocatorError(f"num_tokens must be a positive int, got {num_tokens!r}")
        blocks = self.blocks_for(num_tokens)
        if blocks > self.num_blocks:
            raise AllocatorError(
                f"request for {num_tokens} tokens needs {blocks} blocks of {self.block_size}, "
                f"but the whole pool has only {self.num_blocks} blocks "
                f"({self.num_blocks * self.block_size} tokens)"
            )
        return blocks

    def _take(self, blocks: int) -> list[int]:
        free = self._free
        taken = free[len(free) - blocks:]
        del free[len(free) - blocks:]
        taken.reverse()
        state = self._state
        for b in taken:
            state[b] = _USED
        used = self.num_blocks - len(free)
        self._high_water = max(self._high_water, used)
        return taken

    def try_alloc(self, num_tokens: int, *, priority: bool = False, keep_free: int = 0) -> list[int] | None:
        """Blocks for ``num_tokens`` now, or ``None`` if that would wait.

        Returns ``None`` also when others are already waiting, to keep FIFO order. A
        ``priority`` request only queues behind other priority requests; an ordinary one also
        behind every waiter, and only succeeds if ``keep_free`` blocks remain free after it.
        """
        blocks = self._check_request(num_tokens)
        if self._priority or blocks > len(self._free):
            return None
        if not priority and (self._waiters or blocks + keep_free > len(self._free)):
            return None
        return self._take(blocks)

    async def alloc(
        self, num_tokens: int, *, timeout: float | None = None, priority: bool = False, keep_free: int = 0
    ) -> list[int]:
        """Blocks for ``num_tokens``, waiting (FIFO) for frees when the pool is short.

        ``priority`` requests are served before ordinary ones; an ordinary request is granted
        only while ``keep_free`` blocks stay free for priority ones (the receiver keeps a slice
        of the pool for resume rounds this way, so first reservations cannot starve them).
        Cancellation is safe: a waiter cancelled after being granted gives its blocks back.
        Raises :class:`AllocationTimeout` if ``timeout`` seconds pass first.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        got = self.try_alloc(num_tokens, priority=priority, keep_free=keep_free)
        if got is not None:
            await anyio.lowlevel.cancel_shielded_checkpoint()  # never lose granted blocks to a cancel
            return got
        blocks = self.blocks_for(num_tokens)
        if not priority and blocks + keep_free > self.num_blocks:
            raise AllocatorError(f"request for {num_tokens} tokens ({blocks} blocks) can never be served while "
                                 f"{keep_free} of {self.num_blocks} blocks must stay free")
        waiter = _Waiter(blocks, 0 if priority else keep_free)
        queue = self._priority if priority else self._waiters
        queue.append(waiter)
        self._waited += 1
        try:
            with anyio.fail_after(timeout):
                await waiter.event.wait()
        except BaseException as exc:
            if waiter.granted is not None:
                granted, waiter.granted = waiter.granted, None
                self.free(granted)
            else:
                queue.remove(waiter)
                self._serve()
            if isinstance(exc, TimeoutError):
                raise AllocationTimeout(
                    f"no {waiter.blocks} free blocks for {num_tokens} tokens within {timeout} s "
                    f"({len(self._free)} of {self.num_blocks} free, {len(self._waiters)} other waiters)"
                ) from None
            raise
        assert waiter.granted is not None
        granted, waiter.granted = waiter.granted, None
        return granted

    async def wait_all_free(self) -> None:
        """Wait until every block is free (e.g. to drain before shutdown; bound it with a timeout)."""
        if len(self._free) == self.num_blocks:
            await anyio.lowlevel.checkpoint()
            return
        if self._all_free is None:
            self._all_free = anyio.Event()
        await self._all_free.wait()

    def fence(self, blocks: Iterable[int]) -> None:
        """Mark used blocks as possibly still written by a peer (visible in ``stats.fenced``)."""
        ids = list(blocks)
        self._validate(ids, allowed=(_USED,), action="fence")
        for b in ids:
            self._state[b] = _FENCED
        self._fenced += len(ids)

    def free(self, blocks: Sequence[int] | Iterable[int]) -> None:
        """Return blocks to the pool and serve waiters in FIFO order.

        The whole call is refused (nothing freed) on a double free or a foreign id.
        """
        ids = list(blocks)
        self._validate(ids, allowed=(_USED, _FENCED), action="free")
        state = self._state
        for b in ids:
            if state[b] == _FENCED:
                self._fenced -= 1
            state[b] = _FREE
        self._free.extend(reversed(ids))
        self._serve()
        if self._all_free is not None and len(self._free) == self.num_blocks:
            self._all_free.set()
            self._all_free = None

    def _validate(self, ids: list[int], *, allowed: tuple[int, ...], action: str) -> None:
        state = self._state
        n = self.num_blocks
        seen: set[int] = set()
        for b in ids:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < n:
                raise AllocatorError(f"cannot {action} block {b!r}: not a block id of this pool (0..{n - 1})")
            if state[b] not in allowed or b in seen:
                what = "already free" if state[b] == _FREE or b in seen else "fenced"
                raise AllocatorError(f"cannot {action} block {b}: it is {what} (double {action}?)")
            seen.add(b)

    def _serve(self) -> None:
        priority = self._priority
        while priority and priority[0].blocks <= len(self._free):
            w = priority.popleft()
            w.granted = self._take(w.blocks)
            w.event.set()
        if priority:
            return  # ordinary requests must not take what a waiting priority request needs
        waiters = self._waiters
        while waiters and waiters[0].blocks + waiters[0].keep_free <= len(self._free):
            w = waiters.popleft()
            w.granted = self._take(w.blocks)
            w.event.set()
