"""Log lines for fenced blocks and their release: one per room, until a burst comes.

A sender that dies with a thousand rooms in flight, or a server that cancels a thousand waiting
receives at shutdown, fences a thousand grants within milliseconds; a line per room would bury
everything else in the log. So the first fence (or release) of a kind, reason and sender is logged
in full; the ones that follow within :data:`BURST_WINDOW` seconds go to DEBUG, each still with its
room, and one line at the first one's level sums them up once the window has passed. Nothing is
dropped: the DEBUG lines carry every room, and the metrics count every block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aioembed.protocol.messages import RoomId
from aioembed.protocol.ownership import Fence, Free

__all__ = ["BURST_WINDOW", "FenceLog"]

BURST_WINDOW = 10.0
"""Seconds after a logged fence (or release) during which more of the same are summed up."""


@dataclass(slots=True)
class _Burst:
    first_room: RoomId
    until: float
    rooms: int = 0
    blocks: int = 0


class FenceLog:
    """Logs :class:`Fence` and (fenced-grant) :class:`Free` actions for one pool, bursts summed up.

    Pure bookkeeping: the caller passes the time, and calls :meth:`flush` when :meth:`next_due` comes
    (and at close, with ``final=True``)."""

    def __init__(self, log: logging.Logger, name: str, *, window: float = BURST_WINDOW) -> None:
        self._log = log
        self._name = name
        self._window = window
        self._bursts: dict[tuple[str, str, str], _Burst] = {}

    def fenced(self, a: Fence, now: float) -> None:
        key = ("fenced", a.reason.value, str(a.writer or "no writer"))
        self._note(key, logging.WARNING, a.room, len(a.blocks), now)

    def released(self, a: Free, now: float) -> None:
        key = ("fenced blocks released", a.proof.value, str(a.writer or "no writer"))
        self._note(key, logging.INFO, a.room, len(a.blocks), now)

    def _note(self, key: tuple[str, str, str], level: int, room: RoomId, blocks: int, now: float) -> None:
        self.flush(now)
        what, why, writer = key
        burst = self._bursts.get(key)
        if burst is None:
            self._bursts[key] = _Burst(room, now + self._window)
            line = "blocks fenced" if what == "fenced" else what
            self._log.log(level, "%s: room=%r: %d %s: %s (%s)", self._name, room, blocks, line, why, writer)
            return
        burst.rooms += 1
        burst.blocks += blocks
        self._log.debug("%s: room=%r: %d blocks %s (in the burst after room=%r): %s (%s)", self._name, room,
                        blocks, what, burst.first_room, why, writer)

    def next_due(self) -> float | None:
        """When the earliest open burst should be summed up, if any is open."""
        return min((b.until for b in self._bursts.values()), default=None)

    def flush(self, now: float, *, final: bool = False) -> None:
        """Sum up the bursts whose window has passed (every one if ``final``) and close them."""
        for key, burst in list(self._bursts.items()):
            if burst.until > now and not final:
                continue
            del self._bursts[key]
            if not burst.rooms:
                continue
            what, why, writer = key
            level = logging.WARNING if what == "fenced" else logging.INFO
            verb = "had blocks fenced" if what == "fenced" else "had fenced blocks released"
            self._log.log(level, "%s: %d more rooms after room=%r %s within %.0f s (%d blocks): %s (%s); "
                          "each room is logged at DEBUG", self._name, burst.rooms, burst.first_room, verb,
                          self._window, burst.blocks, why, writer)
