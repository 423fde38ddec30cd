"""How long the event loop went without running: for tests that blocking work stays off the loop."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

__all__ = ["LoopStalls", "loop_stalls"]


class LoopStalls:
    """What :func:`loop_stalls` measured."""

    longest = 0.0
    """Seconds of the longest gap between two runs of the ticker, beyond its own sleep."""


@asynccontextmanager
async def loop_stalls(tick: float = 0.002) -> AsyncIterator[LoopStalls]:
    """Measure, while the block runs, the longest time the loop did not run a ticker sleeping ``tick``
    seconds (any backend)."""
    out = LoopStalls()

    async def ticker() -> None:
        while True:
            t0 = time.perf_counter()
            await anyio.sleep(tick)
            out.longest = max(out.longest, time.perf_counter() - t0 - tick)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(5 * tick)
        out.longest = 0.0
        yield out
        tg.cancel_scope.cancel()
