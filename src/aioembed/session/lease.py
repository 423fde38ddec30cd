"""Leases: rows received zero-copy, as views of pool blocks, until the caller gives them back.

A lease holds readable grants of the receiver's pool. Give it back with :meth:`Lease.release`,
``async with lease:`` or ``async with receiver.lease(room) as lease:``. A lease dropped without
release is still given back, by a finalizer, with a ``ResourceWarning`` naming the room: the pool
must not shrink because a caller forgot one. The finalizer may run on any thread, in the middle of
any code (a garbage collection), so it only queues the grants and wakes the receiver's loop, which
returns them at once (as for a release from another thread).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aioembed.errors import TransferError
from aioembed.memory.device_order import Fence, fence_after, wait_fence
from aioembed.protocol.messages import RoomId
from aioembed.session.async_library import loop_caller
from aioembed.session.handle import TransferStats

__all__ = ["Lease", "LeaseReturns"]

log = logging.getLogger("aioembed.session.receiver")


class LeaseReturns:
    """Where released leases' grants go back to the pool, from whatever thread releases them, once the
    consumer's device work on them is done (a :class:`~aioembed.memory.device_order.Fence`)."""

    def __init__(self, give_back: Callable[[list[int]], None],
                 spawn: Callable[..., object] | None = None) -> None:
        self._give_back = give_back
        self._spawn = spawn
        self._loop_thread = threading.get_ident()
        self._call_soon = loop_caller()  # made on the loop's thread: a room waiting for memory needs the grants now
        self._wake_pending = False
        self._pending: deque[tuple[list[int], Fence | None]] = deque()
        self._waiting: dict[int, tuple[Fence, list[int]]] = {}  # releases whose fence was still pending
        self._keys = itertools.count()
        self.fenced = 0
        """Releases waiting for their consumer's device work to complete."""

    def release(self, grants: list[int], fence: Fence | None = None) -> None:
        """Give ``grants`` back once ``fence`` is done: now if on the loop's thread (and no fence is
        pending), else as soon as the loop (woken) gets to them."""
        if threading.get_ident() == self._loop_thread:
            self._return(grants, fence)
            self.drain()
        else:
            self._pending.append((grants, fence))
            self._wake()

    def release_later(self, grants: list[int], fence: Fence | None = None) -> None:
        """Give ``grants`` back at the loop's next chance, whatever the thread: for a finalizer, which a
        garbage collection may run in the middle of the allocator's or the ledger's own code (returning
        blocks there would corrupt their tables: a block could be handed to two rooms)."""
        self._pending.append((grants, fence))
        self._wake()

    def _wake(self) -> None:
        """Have the loop drain the queue soon: a room already waiting for memory drains nothing itself, and the
        heartbeat would only come ``heartbeat_interval`` later. One wake-up pending is enough (the flag); no
        lock, since a finalizer may run inside this very method on the same thread: a race at worst schedules
        a second, empty drain."""
        if self._wake_pending or self._call_soon is None:
            return
        self._wake_pending = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing drains, the queue goes with it
            self._call_soon(self._woken)

    def _woken(self) -> None:
        self._wake_pending = False  # before the drain: a release queued during it schedules another
        try:
            self.drain()
        except Exception:  # a loop callback must not raise (on trio it would crash the whole run)
            log.exception("giving released leases back to the pool failed")

    def drain(self) -> None:
        """Return grants released from other threads (called on the loop's thread)."""
        while self._pending:
            self._return(*self._pending.popleft())

    def _return(self, grants: list[int], fence: Fence | None) -> None:
        if fence is None or fence.done():
            self._give_back(grants)
            return
        key = next(self._keys)
        self._waiting[key] = (fence, grants)  # until settled: by _after, or by close() if it never ran
        self.fenced += 1
        if self._spawn is None:
            self._settle(key, wait=True)
        else:
            self._spawn(self._after, key)  # a closing receiver starts no task: close() returns them then

    async def _after(self, key: int) -> None:
        try:
            await wait_fence(self._waiting[key][0])
        finally:
            # Done, or the receiver is closing (its tasks are cancelled): no room lands in its pool any
            # more, and the views keep the pool's memory alive, so the blocks may go back either way.
            self._settle(key, wait=False)

    def _settle(self, key: int, *, wait: bool) -> None:
        entry = self._waiting.pop(key, None)
        if entry is None:
            return
        fence, grants = entry
        self.fenced -= 1
        if wait:
            fence.wait()  # no loop to wait on (a receiver closing): wait here rather than free early
        self._give_back(grants)

    def close(self) -> None:
        """The receiver's tasks have ended: return what is still queued (released off the loop's thread) or
        waiting for its fence (its task refused, or never started, once the receiver was closing); later
        releases return at once."""
        self._spawn = None
        self.drain()
        for key in list(self._waiting):
            self._settle(key, wait=True)

    @property
    def pending(self) -> int:
        """Releases from other threads not yet returned."""
        return len(self._pending)


def _take_release(state: dict[str, bool]) -> bool:
    """True for the one caller that releases: one ``dict.pop``, atomic, so two threads (or a thread and
    a finalizer) releasing at once cannot both give the grants back."""
    return state.pop("held", False)


def _dropped(returns: LeaseReturns, grants: list[int], room: RoomId, state: dict[str, bool],
             devices: tuple[torch.device, ...]) -> None:
    if not _take_release(state):
        return
    warnings.warn(f"a Lease of room {room!r} was garbage-collected without release(); its "
                  f"{len(grants)} grant(s) went back to the pool now. Use `async with lease:`.",
                  ResourceWarning, stacklevel=2)
    # Kernels queued on the current stream may still read the views: order after them.
    fence = fence_after([torch.empty(0, device=d) for d in devices]) if devices else None
    returns.release_later(grants, fence)


class Lease:
    """A request received zero-copy: per field, views of pool blocks in token order.

    The views stay valid until :meth:`release`; after it the blocks go to other rooms and the
    views must not be read. Use ``async with lease:`` (or ``with lease:``) to release on exit.
    """

    def __init__(self, *, room: RoomId, views: dict[str, list[torch.Tensor]], metadata: dict[str, Any],
                 num_tokens: int, rounds: int, stats: TransferStats, grants: list[int],
                 returns: LeaseReturns) -> None:
        self.room = room
        self.views = views
        self.metadata = metadata
        self.num_tokens = num_tokens
        self.rounds = rounds
        self.stats = stats
        self._grants = grants
        self._returns = returns
        self._state = {"held": True}
        devices = tuple({v.device for vs in views.values() for v in vs if v.device.type == "cuda"})
        self._finalizer = weakref.finalize(self, _dropped, returns, grants, room, self._state, devices)
        self.part_metadata: tuple[dict[str, Any], ...] = ()
        """For a room received in parts: each part's metadata, in part order."""

    @classmethod
    def combine(cls, room: RoomId, leases: Sequence[Lease], *, metadata: dict[str, Any],
                stats: TransferStats) -> Lease:
        """One lease over the parts' leases (in token order), which it takes over."""
        if not leases or any(lease.released for lease in leases):
            raise TransferError(f"room {room!r}: cannot combine released or missing part leases", room=room)
        views: dict[str, list[torch.Tensor]] = {name: [] for name in leases[0].views}
        grants: list[int] = []
        for lease in leases:
            for name, vs in lease.views.items():
                views[name].extend(vs)
            grants.extend(lease._grants)
            _take_release(lease._state)  # its grants are the combined lease's now
            lease._finalizer.detach()
        return cls(room=room, views=views, metadata=metadata, num_tokens=sum(lease.num_tokens for lease in leases),
                   rounds=max(lease.rounds for lease in leases), stats=stats, grants=grants,
                   returns=leases[0]._returns)

    @property
    def released(self) -> bool:
        """True once the blocks went back to the pool."""
        return not self._state.get("held", False)

    def release(self, stream: torch.cuda.Stream | None = None) -> None:
        """Give the blocks back to the pool (idempotent).

        For views on a CUDA device, the blocks go back only once the work queued so far on ``stream``
        (default: the device's current stream) has completed: kernels already queued on the views may
        still read them, and the next room's rows must not land under them."""
        if not _take_release(self._state):
            return
        self._finalizer.detach()
        fence = fence_after((v for vs in self.views.values() for v in vs), stream)
        self.views = {name: [] for name in self.views}
        self._returns.release(self._grants, fence)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Contiguous copies of every field (what ``receive()`` would have returned)."""
        if self.released:
            raise TransferError(f"room {self.room!r}: lease already released", room=self.room)
        return {name: torch.cat(vs) if len(vs) != 1 else vs[0].clone() for name, vs in self.views.items()}

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else f"{len(self._grants)} grants"
        return f"<Lease room={self.room!r} {self.num_tokens} tokens, {state}>"
