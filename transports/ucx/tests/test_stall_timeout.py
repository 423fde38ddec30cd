"""The stall timer that bounds a UCX write (and the owner's side of it) without a task of its own."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest

from aioembed_ucx.transport import _Progress, _StallTimeout

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_no_progress_for_the_timeout_cancels_the_work() -> None:
    start = time.monotonic()
    with _StallTimeout(_Progress(), 0.05) as stall:
        await asyncio.sleep(5)
    assert stall.expired and time.monotonic() - start < 1.0


async def test_progress_on_the_connection_keeps_a_long_write_alive() -> None:
    progress = _Progress()
    with _StallTimeout(progress, 0.05) as stall:
        for _ in range(10):  # 0.2 s in all, never 0.05 s without progress
            await asyncio.sleep(0.02)
            progress.tick()
    assert not stall.expired


async def test_an_outer_cancellation_is_not_taken_for_a_stall() -> None:
    with anyio.CancelScope() as outer:
        with _StallTimeout(_Progress(), 5.0) as stall:
            outer.cancel()
            await asyncio.sleep(5)
    assert outer.cancelled_caught and not stall.expired


async def test_firing_as_the_work_finishes_without_an_await_left_is_no_timeout() -> None:
    progress = _Progress()
    with _StallTimeout(progress, 0.01) as stall:
        stall._start = progress.last = time.monotonic() - 1.0  # as if the loop had been busy past the deadline
        stall._check()  # the timer runs only now, and nothing awaits after it
        assert stall.expired  # it fired ...
    assert not stall.expired  # ... but the work finished: not a timeout
