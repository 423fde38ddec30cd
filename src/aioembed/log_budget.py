"""Warnings about what a peer sends, or a plugin or a caller's hook does wrong: at most one of a kind every so often.

A peer that sends bad or refused frames as fast as it can would otherwise get one WARNING line per frame (200,000
junk frames made 200,000 lines): enough to fill a disk over weeks and to bury everything else. The first of a kind
is a WARNING; the ones that follow within :data:`WINDOW` seconds go to DEBUG, each still in full, and the next
WARNING of that kind says how many there were. Nothing is dropped. (Fences have their own summing up:
:mod:`aioembed.session.fence_log`.)
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["WINDOW", "WarningBudget"]

WINDOW = 10.0
"""Seconds after a WARNING of a kind during which more of that kind go to DEBUG."""


class WarningBudget:
    """One WARNING per kind and :data:`WINDOW` (a kind is a call site: the set of kinds is fixed and small)."""

    def __init__(self, log: logging.Logger, *, window: float = WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._window = window
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def warn(self, kind: str, msg: str, *args: object) -> None:
        """``log.warning(msg, *args)``, or ``log.debug`` if a WARNING of ``kind`` went out less than the window
        ago (counted in the next one)."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._window:
            self._held[kind] += 1
            self._log.debug(msg, *args)
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        if held:
            self._log.warning(msg + " (and %d more like it since the last such warning, logged at DEBUG)", *args, held)
        else:
            self._log.warning(msg, *args)
