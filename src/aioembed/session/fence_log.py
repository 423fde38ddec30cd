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
import math
from dataclasses import dataclass, field

from aioembed.protocol.messages import RoomId
from aioembed.protocol.ownership import Fence, Free

__all__ = ["BURST_WINDOW", "FenceLog"]

BURST_WINDOW = 10.0
"""Seconds after a logged fence (or release) during which more of the same are summed up."""

_FENCED, _RELEASED = "fenced", "released"
_LEVELS = {_FENCED: logging.WARNING, _RELEASED: logging.INFO}
_NOUNS = {_FENCED: ("block fenced", "blocks fenced"), _RELEASED: ("fenced block released", "fenced blocks released")}


def _blocks(kind: str, n: int, more: str = "") -> str:
    """``"3 blocks fenced"``, ``"1 more fenced block released"``."""
    return f"{n} {more}{_NOUNS[kind][n != 1]}"


@dataclass(slots=True)
class _Burst:
    first_room: RoomId
    until: float
    blocks: int = 0
    """Blocks of the actions after the first one (a room may have several grants)."""
    rooms: set[RoomId] = field(default_factory=set)
    """Rooms after the first one."""


class FenceLog:
    """Logs :class:`Fence` and (fenced-grant) :class:`Free` actions for one pool, bursts summed up.

    Pure bookkeeping: the caller passes the time, calls :meth:`flush` when :meth:`next_due` comes, and
    :meth:`close` at the end (after which every line is logged in full: no burst would be summed up)."""

    def __init__(self, log: logging.Logger, name: str, *, window: float | None = None) -> None:
        self._log = log
        self._name = name
        self._window = BURST_WINDOW if window is None else window
        self._bursts: dict[tuple[str, str, str], _Burst] = {}
        self._closed = False

    def fenced(self, a: Fence, now: float) -> None:
        """Blocks of ``a.room`` were fenced: a write may still reach them (WARNING)."""
        self._note((_FENCED, a.reason.value, str(a.writer or "no writer")), a.room, len(a.blocks), now)

    def released(self, a: Free, now: float) -> None:
        """Fenced blocks of ``a.room`` came back: a proof said no write can reach them (INFO)."""
        self._note((_RELEASED, a.proof.value, str(a.writer or "no writer")), a.room, len(a.blocks), now)

    def _note(self, key: tuple[str, str, str], room: RoomId, blocks: int, now: float) -> None:
        self.flush(now)
        what, why, writer = key
        burst = self._bursts.get(key)
        if burst is None:
            if not self._closed:
                self._bursts[key] = _Burst(room, now + self._window)
            self._log.log(_LEVELS[what], "%s: room=%r: %s: %s (%s)", self._name, room, _blocks(what, blocks), why,
                          writer)
            return
        if room != burst.first_room:
            burst.rooms.add(room)
        burst.blocks += blocks
        self._log.debug("%s: room=%r: %s (in the burst after room=%r): %s (%s)", self._name, room,
                        _blocks(what, blocks), burst.first_room, why, writer)

    def next_due(self) -> float | None:
        """When the earliest open burst should be summed up, if any is open."""
        return min((b.until for b in self._bursts.values()), default=None)

    def flush(self, now: float) -> None:
        """Sum up the bursts whose window has passed, and close them."""
        for key, burst in list(self._bursts.items()):
            if burst.until <= now:
                self._sum_up(key, burst)

    def close(self) -> None:
        """Sum up every open burst now; from here on every line is logged in full."""
        self._closed = True
        self.flush(math.inf)

    def _sum_up(self, key: tuple[str, str, str], burst: _Burst) -> None:
        del self._bursts[key]
        if not burst.blocks:
            return
        what, why, writer = key
        rooms = len(burst.rooms)
        self._log.log(_LEVELS[what], "%s: %s in the %g s after room=%r (%d other room%s): %s (%s); each is logged "
                      "at DEBUG", self._name, _blocks(what, burst.blocks, "more "), self._window, burst.first_room,
                      rooms, "" if rooms == 1 else "s", why, writer)
