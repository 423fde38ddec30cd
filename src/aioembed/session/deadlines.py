"""One task that acts when the earliest of a changing set of deadlines comes, counting only time
the process was running.

Timed releases of fenced blocks (receiver) and the expiry of writes that may still land (sender)
are windows of *running* time: data that waited in a socket buffer lands as soon as a frozen
process thaws. A wake-up later than the stall tolerance means the loop did not run meanwhile, and
the owner is told to restart its windows instead of acting.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import anyio

from aioembed.errors import InvalidRequest
from aioembed.session.liveness import LoopWatch

__all__ = ["DeadlineTimer", "timeout_seconds"]


def timeout_seconds(name: str, value: object, default: float) -> float:
    """A caller's ``timeout=`` argument (``None``: ``default``) as seconds, or ``InvalidRequest`` saying what came
    (a string, say, escaped as a bare ``TypeError`` from inside anyio)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidRequest(f"{name}={value!r} must be a number of seconds (or None: the default, {default} s)")
    return float(value)


class DeadlineTimer:
    """Calls ``due(now)`` when ``next_deadline()`` comes, or ``stalled(now)`` after a late wake-up.

    A wake-up only at the deadline sees a stall that lasted across it, not one that ended before it (the window
    then ends an instant after the thaw). With ``watch_every``, a pending deadline is slept towards in steps of at
    most that many seconds, each checked for lateness like a heartbeat (late by more than a step: ordinary lag on a
    busy host must not restart the windows for ever): for an owner with no other task that watches the loop while
    its windows run (a receiver whose senders are gone has no heartbeats)."""

    def __init__(self, next_deadline: Callable[[], float | None], due: Callable[[float], None],
                 stalled: Callable[[float], None], *, stall_tolerance: float, watch_every: float | None = None) -> None:
        self._next = next_deadline
        self._due = due
        self._stalled = stalled
        self.watch = LoopWatch(stall_tolerance)
        self._steps = LoopWatch(watch_every) if watch_every is not None else None
        self._wake: anyio.Event | None = None

    def wake(self) -> None:
        """The deadlines changed: look again."""
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        """The timer task (cancel it to stop)."""
        while True:
            self._wake = wake = anyio.Event()
            deadline = self._next()
            if deadline is None:
                await wake.wait()
                continue
            until = deadline
            if self._steps is not None:
                until = min(deadline, anyio.current_time() + self._steps.interval)
            with anyio.move_on_after(max(0.0, until - anyio.current_time())):
                await wake.wait()
            if wake.is_set():
                continue  # the deadlines changed: look again
            now = anyio.current_time()
            if until < deadline:  # a step of the watch
                assert self._steps is not None
                if self._steps.woke(now, until):
                    self._stalled(now)
                continue
            if self.watch.woke(now, deadline):
                self._stalled(now)
                continue
            self._due(now)
