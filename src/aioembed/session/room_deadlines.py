"""The deadlines of many rooms, kept by one task instead of an event-loop timer each.

A deadline on an anyio cancel scope (or a ``move_on_after``) is a timer of the event loop: setting, moving or
dropping it makes or cancels a timer handle (with a copy of the context), and a wait under a deadline takes a
cancel scope of its own. A room set three or four (the room's, and each wait's) and dropped them all long
before they came due, since a room takes milliseconds and its timeouts are tens of seconds: microseconds of
the loop each, on the path of every small request.

Here a deadline is a dict entry: setting, moving and dropping one cost a dict operation. One task (a
:class:`~aioembed.session.deadlines.DeadlineTimer`, as for the fences' timed releases) sleeps until the earliest
deadline and calls what is due (a scope's ``cancel``, an event's ``set``). It is woken only by a deadline earlier
than the one it sleeps towards; a dropped deadline does not wake it, so it wakes
at that time for nothing, looks over the deadlines left (all of them: a few per room in flight) and sleeps
until the earliest. Since a room's deadlines are set later than its elders', it runs about once per timeout,
not once per room.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable

from aioembed.session.deadlines import DeadlineTimer

__all__ = ["RoomDeadlines"]

log = logging.getLogger(__name__)


class RoomDeadlines:
    """Deadlines by key; :meth:`run` is the task that keeps them.

    A deadline that passes is forgotten and its action called (``scope.cancel``, as an anyio deadline would;
    an event's ``set``, to wake a wait that then looks at the clock); the owner tells a deadline from another
    cancellation by its own bookkeeping. A deadline is wall-clock time, as an anyio one: one that passed while
    the process was frozen comes due when it thaws (no stall tolerance)."""

    def __init__(self) -> None:
        self._deadlines: dict[Hashable, tuple[float, Callable[[], object]]] = {}
        self._armed = math.inf  # the deadline the task sleeps towards
        self._timer = DeadlineTimer(self._earliest, self._expire, self._expire, stall_tolerance=math.inf)
        self.expired = 0
        """Deadlines that passed (actions called by this task)."""
        self.scans = 0
        """Times the task looked over every deadline."""

    async def run(self) -> None:
        """The task (its owner cancels it to stop)."""
        await self._timer.run()

    def __len__(self) -> int:
        return len(self._deadlines)

    def set(self, key: Hashable, deadline: float, action: Callable[[], object]) -> None:
        """Call ``action`` at ``deadline`` (``anyio.current_time()``'s clock) unless :meth:`drop` comes first;
        replaces the deadline ``key`` had. ``action`` runs in this task: it must not block or raise."""
        self._deadlines[key] = (deadline, action)
        if deadline < self._armed:
            self._timer.wake()

    def drop(self, key: Hashable) -> None:
        """Forget the deadline of ``key`` (none: nothing happens)."""
        self._deadlines.pop(key, None)

    def _earliest(self) -> float | None:
        """What the task sleeps towards (None: until woken)."""
        self.scans += 1
        self._armed = min((deadline for deadline, _ in self._deadlines.values()), default=math.inf)
        return None if self._armed == math.inf else self._armed

    def _expire(self, now: float) -> None:
        """Call the actions whose deadline is ``now`` or earlier."""
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
