"""The deadlines of many rooms, kept by one task instead of an event-loop timer each.

A deadline on an anyio cancel scope (or a ``move_on_after``) is a timer of the event loop: setting, moving or
dropping it makes or cancels a timer handle (with a copy of the context), and a wait under a deadline takes a
cancel scope of its own. A room set three or four (the room's, and each wait's) and dropped them all long
before they came due, since a room takes milliseconds and its timeouts are tens of seconds: microseconds of
the loop each, on the path of every small request.

Here a deadline is a dict entry: setting, moving and dropping one cost a dict operation. One task sleeps
until the earliest deadline and calls what is due (a scope's ``cancel``, an event's ``set``). It is woken
only by a deadline earlier than the one it sleeps towards; a dropped deadline does not wake it, so it wakes
at that time for nothing, looks over the deadlines left (all of them: a few per room in flight) and sleeps
until the earliest. Since a room's deadlines are set later than its elders', it runs about once per timeout,
not once per room.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable

import anyio

__all__ = ["RoomDeadlines"]

log = logging.getLogger(__name__)


class RoomDeadlines:
    """Deadlines by key; :meth:`run` is the task that keeps them.

    A deadline that passes is forgotten and its action called (``scope.cancel``, as an anyio deadline would;
    an event's ``set``, to wake a wait that then looks at the clock); the owner tells a deadline from another
    cancellation by its own bookkeeping."""

    def __init__(self) -> None:
        self._deadlines: dict[Hashable, tuple[float, Callable[[], object]]] = {}
        self._armed = math.inf  # the deadline the task sleeps towards
        self._wake: anyio.Event | None = None
        self.expired = 0
        """Deadlines that passed (actions called by this task)."""
        self.scans = 0
        """Times the task looked over every deadline."""

    def __len__(self) -> int:
        return len(self._deadlines)

    def set(self, key: Hashable, deadline: float, action: Callable[[], object]) -> None:
        """Call ``action`` at ``deadline`` (``anyio.current_time()``'s clock) unless :meth:`drop` comes first;
        replaces the deadline ``key`` had. ``action`` runs in this task: it must not block or raise."""
        self._deadlines[key] = (deadline, action)
        if deadline < self._armed and self._wake is not None:
            self._wake.set()

    def drop(self, key: Hashable) -> None:
        """Forget the deadline of ``key`` (none: nothing happens)."""
        self._deadlines.pop(key, None)

    def _expire(self, now: float) -> float:
        """Call the actions whose deadline is ``now`` or earlier; returns the earliest deadline left."""
        self.scans += 1
        due = [key for key, (deadline, _) in self._deadlines.items() if deadline <= now]
        for key in due:
            entry = self._deadlines.get(key)
            if entry is None or entry[0] > now:  # an earlier action dropped or moved it
                continue
            del self._deadlines[key]
            self.expired += 1
            try:
                entry[1]()
            except Exception:  # a bug: the other rooms' deadlines must still come
                log.exception("the deadline of %r: its action failed", key)
        return min((deadline for deadline, _ in self._deadlines.values()), default=math.inf)

    async def run(self) -> None:
        """The task (its owner cancels it to stop)."""
        while True:
            self._wake = wake = anyio.Event()
            now = anyio.current_time()
            self._armed = earliest = self._expire(now)
            with anyio.CancelScope(deadline=earliest):  # math.inf: until woken
                await wake.wait()
