"""Leases: rows received zero-copy, as views of pool blocks, until the caller gives them back.

A lease holds readable grants of the receiver's pool. Give it back with :meth:`Lease.release`,
``async with lease:`` or ``async with receiver.lease(room) as lease:``. A lease dropped without
release is still given back, by a finalizer, with a ``ResourceWarning`` naming the room: the pool
must not shrink because a caller forgot one. The finalizer may run on any thread (a garbage
collection in a worker thread); it then hands the blocks to the receiver's loop, which returns
them at its next heartbeat at the latest.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aioembed.errors import TransferError
from aioembed.protocol.messages import RoomId
from aioembed.session.handle import TransferStats

__all__ = ["Lease", "LeaseReturns"]


class LeaseReturns:
    """Where released leases' grants go back to the pool, from whatever thread releases them."""

    def __init__(self, give_back: Callable[[list[int]], None]) -> None:
        self._give_back = give_back
        self._loop_thread = threading.get_ident()
        self._pending: deque[list[int]] = deque()

    def release(self, grants: list[int]) -> None:
        """Give ``grants`` back now if on the loop's thread, else at the loop's next chance."""
        if threading.get_ident() == self._loop_thread:
            self._give_back(grants)
            self.drain()
        else:
            self._pending.append(grants)

    def drain(self) -> None:
        """Return grants released from other threads (called on the loop's thread)."""
        while self._pending:
            self._give_back(self._pending.popleft())

    @property
    def pending(self) -> int:
        """Releases from other threads not yet returned."""
        return len(self._pending)


def _dropped(returns: LeaseReturns, grants: list[int], room: RoomId, state: dict[str, bool]) -> None:
    if state["released"]:
        return
    state["released"] = True
    warnings.warn(f"a Lease of room {room!r} was garbage-collected without release(); its "
                  f"{len(grants)} grant(s) went back to the pool now. Use `async with lease:`.",
                  ResourceWarning, stacklevel=2)
    returns.release(grants)


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
        self._state = {"released": False}
        self._finalizer = weakref.finalize(self, _dropped, returns, grants, room, self._state)
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
            lease._state["released"] = True  # its grants are the combined lease's now
            lease._finalizer.detach()
        return cls(room=room, views=views, metadata=metadata, num_tokens=sum(lease.num_tokens for lease in leases),
                   rounds=max(lease.rounds for lease in leases), stats=stats, grants=grants,
                   returns=leases[0]._returns)

    @property
    def released(self) -> bool:
        """True once the blocks went back to the pool."""
        return self._state["released"]

    def release(self) -> None:
        """Give the blocks back to the pool (idempotent)."""
        if self._state["released"]:
            return
        self._state["released"] = True
        self._finalizer.detach()
        self.views = {name: [] for name in self.views}
        self._returns.release(self._grants)

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
