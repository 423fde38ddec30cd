"""Liveness, shared by both sides: when a peer counts as silent, and when *we* were not running.

A peer is silent after ``heartbeat_misses`` intervals without a frame from it. Silence we could
not have heard is not the peer's fault: if our own loop stalled (a frozen process, a long
synchronous prefill), every peer is forgiven up to the stall, once per silence (a loop late on every
wake-up must still find a dead peer). Silence only ever ends a room and
fences its blocks; freeing them needs proof (see :mod:`aioembed.protocol.ownership`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoopWatch", "PeerClock"]


class LoopWatch:
    """Detects stalls of our own event loop from late wake-ups of a periodic task.

    ``woke(now, expected)`` is called by a task that slept until ``expected``; a wake-up later
    than ``tolerance`` means the loop did not run meanwhile.
    """

    def __init__(self, interval: float, *, tolerance: float | None = None) -> None:
        self.interval = interval
        self.tolerance = interval if tolerance is None else tolerance
        self.stalls = 0
        self.last_stall: float | None = None

    def woke(self, now: float, expected: float) -> float:
        """Seconds the loop stalled before this wake-up (0.0 if it was on time)."""
        late = now - expected
        if late <= self.tolerance:
            return 0.0
        self.stalls += 1
        self.last_stall = now
        return late


@dataclass(slots=True)
class PeerClock:
    """When we last heard from one peer."""

    last_heard: float
    forgiven: bool = False
    """A stall of ours was forgiven since the peer was last heard."""

    def heard(self, now: float) -> None:
        """A frame from the peer arrived."""
        self.last_heard = now
        self.forgiven = False

    def forgive(self, now: float, interval: float) -> None:
        """Our loop stalled until ``now``: count the peer as heard one interval ago at worst.

        Once per silence: after one forgiveness the frames a live peer sent meanwhile, queued in our socket, are
        read as soon as the loop runs, and hearing them makes the next stall forgivable again. A loop late on
        *every* wake-up (a saturated server, a CPU-bound handler) forgave a dead peer at each one, so it was never
        found silent; now it is, one silence window after the first forgiveness. A single stall, however long,
        is still forgiven (silence only ever ends sessions and fences blocks: it never frees them)."""
        if self.forgiven:
            return
        self.forgiven = True
        self.last_heard = max(self.last_heard, now - interval)

    def silent(self, now: float, limit: float) -> bool:
        """True once nothing came for more than ``limit`` seconds."""
        return now - self.last_heard > limit
