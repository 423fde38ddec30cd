"""How long the event loop went without running: for tests that blocking work stays off the loop."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

from aioembed.bench.event_channel import claim_stdout, emit, last_event

__all__ = ["LoopStalls", "check_first_open_leaves_the_loop_running", "loop_stalls", "open_stalls"]


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


async def open_stalls(transport: str, options: Mapping[str, Any]) -> dict[str, float]:
    """Open (and close) one endpoint of ``transport`` while measuring the loop: ``{"open": seconds the
    open took, "longest": the longest stall meanwhile}``. Meaningful in a fresh process only, where the
    open loads the engine's native libraries (see :func:`main`)."""
    from aioembed.transports.registry import open_transport

    async with loop_stalls() as stalls:
        t0 = time.perf_counter()
        endpoint = await open_transport(transport, options)
        took = time.perf_counter() - t0
        await anyio.sleep(0.02)  # the ticker's wake-up after the open records its stall
        await endpoint.aclose()
    return {"open": took, "longest": stalls.longest}


OPEN_ATTEMPTS = 3
"""Fresh processes :func:`check_first_open_leaves_the_loop_running` may try: other processes on a busy host (CI
runs the plugin suites side by side on 2 cores) delay the ticker's wake-ups, and one open in a few showed a stall of
a third of it (0.29 of 0.84 s). A load that holds the GIL stalls every open for all of it, in every attempt."""


def check_first_open_leaves_the_loop_running(transport: str, options: Mapping[str, Any]) -> None:
    """For a plugin's tests: open ``transport`` in a fresh process (where its engine's native libraries
    load) and assert that the loop stalled for less than a third of the open (a load that holds the GIL
    stalls it for all of it), in one of :data:`OPEN_ATTEMPTS` fresh processes."""
    tries: list[dict[str, Any]] = []
    for _ in range(OPEN_ATTEMPTS):
        run = subprocess.run([sys.executable, "-m", "aioembed.testing.loop", transport, json.dumps(dict(options))],
                             capture_output=True, text=True, timeout=120, check=True)
        got = last_event(run.stdout.encode(), "loop child")
        assert got is not None, f"the child printed no result: {run.stdout[-2000:]} {run.stderr[-2000:]}"
        assert got["open"] > 0.1, f"the open loaded nothing slow in this fresh process, so it shows nothing: {got}"
        tries.append(got)
        if got["longest"] < got["open"] / 3:
            return
    raise AssertionError(f"the loop stalled for a third of the open or more in each of {len(tries)} fresh "
                         f"processes: {tries}")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m aioembed.testing.loop TRANSPORT [OPTIONS_JSON]``: :func:`open_stalls` in this (fresh)
    process, printed as one JSON line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        raise SystemExit("usage: python -m aioembed.testing.loop TRANSPORT [OPTIONS_JSON]")
    options = json.loads(args[1]) if len(args) > 1 else {}
    emit(**anyio.run(open_stalls, args[0], options))


if __name__ == "__main__":
    claim_stdout()  # native libraries print to fd 1: keep it for the result line only
    main()
