"""A receiving room's inbox: the frames and session losses its connection hands to the room's driver.

Not an anyio memory object stream: that hands an item straight to a waiting receiver, and on asyncio a
plain ``Task.cancel()`` reaching the receiver before it resumes (``asyncio.timeout`` or ``wait_for``
around ``receive()``, a server dropping the request) raises out of ``receive()`` with the item gone.
A frame is a proof about the room's blocks (a ``STATUS`` says which writes ended): the room's end hands
every frame it did not act on to the connection, and a dropped one left blocks fenced until the sender
answered again. Here an item leaves the queue only when the driver takes it, so a cancelled wait loses
nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import anyio

__all__ = ["RoomInbox"]

T = TypeVar("T")


class RoomInbox(Generic[T]):
    """A bounded FIFO queue with one consumer (the room's driver); ``put`` never blocks."""

    __slots__ = ("_capacity", "_closed", "_items", "_waiter")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a room's inbox needs room for at least one event, got capacity={capacity}")
        self._items: deque[T] = deque()
        self._capacity = capacity
        self._closed = False
        self._waiter: anyio.Event | None = None

    def put(self, item: T) -> None:
        """Queue ``item``. Raises ``anyio.ClosedResourceError`` once closed (the room ended) and
        ``anyio.WouldBlock`` when full (a sender sending more than the protocol allows)."""
        if self._closed:
            raise anyio.ClosedResourceError
        if len(self._items) >= self._capacity:
            raise anyio.WouldBlock
        self._items.append(item)
        if self._waiter is not None:
            self._waiter.set()

    def get_nowait(self) -> T:
        """The oldest item; ``anyio.WouldBlock`` when there is none. What was queued before
        :meth:`close` can still be taken after it."""
        if not self._items:
            raise anyio.WouldBlock
        return self._items.popleft()

    async def get(self) -> T:
        """The oldest item, waiting for one if there is none (``anyio.EndOfStream`` once closed and
        empty). A cancelled wait takes nothing: an item that came meanwhile stays first in line."""
        while not self._items:
            if self._closed:
                raise anyio.EndOfStream
            if self._waiter is not None:
                raise RuntimeError("a room's inbox has one consumer, its driver; a second one waited on it")
            self._waiter = waiter = anyio.Event()
            try:
                await waiter.wait()
            finally:
                self._waiter = None
        return self._items.popleft()

    def close(self) -> None:
        """No more items (the room ended); wakes a waiting :meth:`get`."""
        self._closed = True
        if self._waiter is not None:
            self._waiter.set()

    @property
    def capacity(self) -> int:
        """The most items it queues."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._items)
