"""How many write-header bytes one connection may have announced and not yet finished with.

An owner reads a write's fixed prefix, then allocates the body it announces (up to ``MAX_BODY``) and reads it
in a task of its own, going straight back to the next prefix. Nothing bounded how many such bodies one peer
could announce: a hostile or broken writer sending prefixes alone made the owner allocate 64 MiB per prefix,
without end. Each connection's bodies in progress now share one budget; the connection's reader takes a write's
body from it before it starts the write's task and waits (reading nothing more from that peer) while the budget
is spent. A write gives its body back when its task ends, done, refused or failed: a peer whose bodies never come
is aborted by the stall timeout of its writes (``write_timeout``), which gives them all back.

The transport takes each body from a second budget too, shared by all its connections
(``TRANSPORT_BODY_BUDGET``), so the total does not grow with the number of peers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["BodyBudget"]


class BodyBudget:
    """Body bytes of one connection's writes in progress, at most ``limit`` (a single body up to ``limit``)."""

    def __init__(self, limit: int, on_change: Callable[[int], None] | None = None) -> None:
        if limit <= 0:
            raise ValueError(f"limit={limit} must be > 0 (body bytes one connection may hold)")
        self.limit = limit
        self.held = 0
        self._on_change = on_change
        self._freed = asyncio.Event()

    async def take(self, nbytes: int) -> None:
        """Hold ``nbytes`` once they fit (at once when nothing is held: a body is never larger than the limit)."""
        while not self.try_take(nbytes):
            self._freed.clear()
            await self._freed.wait()

    def try_take(self, nbytes: int) -> bool:
        """Hold ``nbytes`` if they fit now, as :meth:`take` would without waiting."""
        if nbytes < 0 or nbytes > self.limit:
            raise ValueError(f"nbytes={nbytes} must be in [0, {self.limit}]")
        if self.held and self.held + nbytes > self.limit:
            return False
        self._add(nbytes)
        return True

    def give(self, nbytes: int) -> None:
        """Give back what :meth:`take` held for one write."""
        if not 0 <= nbytes <= self.held:
            raise ValueError(f"nbytes={nbytes} given back, {self.held} held")
        self._add(-nbytes)
        self._freed.set()

    def _add(self, delta: int) -> None:
        self.held += delta
        if self._on_change is not None and delta:
            self._on_change(delta)
