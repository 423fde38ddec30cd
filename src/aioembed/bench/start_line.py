"""A common start instant for the two processes of a timed transfer.

A two-process point times a transfer from the first of its two calls (``send()`` in the bench process,
``receive()`` in the receiving child) to both done. Were ``send()`` called as soon as the command to the
child is written, the command's trip through the pipe and the idle child's wake-up (0.04 ms after a short
transfer, 0.6 ms after a 40 ms one, measured) would count as aioembed's time, which no real deployment
pays and the raw baseline never does. So the command carries an instant a little ahead (:data:`LEAD_S`),
and both processes make their call at that instant: the clock then starts at a moment both sides were
ready for. A child that is late all the same is timed from the start line, i.e. its lateness still counts
against aioembed (never in its favour).

Sleeping alone would miss the instant: asyncio's timers wake up to a millisecond late (``epoll`` counts
in milliseconds). So each side sleeps until :data:`SPIN_S` before it and spins on the clock for the
rest: a bounded busy wait of at most that long per transfer, in a benchmark process only.
"""

from __future__ import annotations

import time

import anyio

__all__ = ["LEAD_S", "SPIN_S", "reach", "start_at"]

LEAD_S = 0.003
"""How far ahead of now the start line is set: more than the command's trip and the child's wake-up."""

SPIN_S = 0.0015
"""The last part of the wait, spent checking the clock rather than asleep."""


def start_at() -> float:
    """A start line :data:`LEAD_S` from now, on ``time.monotonic`` (one clock for every process here)."""
    return time.monotonic() + LEAD_S


async def reach(at: float) -> float:
    """Return at instant ``at`` (at once if it has passed): ``time.monotonic()`` on return."""
    ahead = at - time.monotonic() - SPIN_S
    if ahead > 0:
        await anyio.sleep(ahead)
    now = time.monotonic()
    while now < at:
        now = time.monotonic()
    return now
