"""``ArmedProgress`` against a scripted worker: progress and re-arm on every event, retry on the next loop
turn while the worker is busy, wake waiters only after progress, and replace a driver whose worker is
gone. The worker's epoll descriptor is a pipe: a byte written is an event, a successful arm drains it."""

from __future__ import annotations

import asyncio
import importlib
import os
import types
from collections.abc import Iterator

import pytest

from aioembed_ucx._progress import ArmedProgress, install_armed_progress

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ScriptedWorker:
    def __init__(self, busy_arms: int = 0) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self.busy_arms = busy_arms
        self.progressed = 0
        self.on_progress: list[Request] = []

    @property
    def epoll_file_descriptor(self) -> int:
        return self._r

    def init_blocking_progress_mode(self) -> None:
        pass

    def progress(self) -> None:
        self.progressed += 1
        for r in self.on_progress:
            r.completed = True
        self.on_progress.clear()

    def arm(self) -> bool:
        if self.busy_arms > 0:
            self.busy_arms -= 1
            return False
        try:
            while os.read(self._r, 64):
                pass
        except BlockingIOError:
            pass
        return True

    def event(self) -> None:
        os.write(self._w, b"x")

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


class Request:
    def __init__(self) -> None:
        self.completed = False
        self.error: Exception | None = None

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error


@pytest.fixture
def worker() -> Iterator[ScriptedWorker]:
    w = ScriptedWorker()
    yield w
    w.close()


async def test_an_event_is_progressed_and_the_worker_armed_again(worker: ScriptedWorker) -> None:
    driver = ArmedProgress(worker, asyncio.get_running_loop())
    try:
        assert driver.arms == 1 and worker.progressed == 1  # armed at start
        for n in range(2, 5):
            worker.event()
            await asyncio.sleep(0.02)
            assert driver.arms == n and worker.progressed == n
        idle = worker.progressed
        await asyncio.sleep(0.2)
        assert worker.progressed == idle  # no event, no progress: nothing polls
    finally:
        driver.close()


async def test_a_busy_worker_is_tried_again_on_the_next_loop_turn(worker: ScriptedWorker) -> None:
    worker.busy_arms = 20  # more than one callback's attempts
    driver = ArmedProgress(worker, asyncio.get_running_loop())
    try:
        assert driver.arms == 0 and driver.retries == 1
        await asyncio.sleep(0.02)
        assert driver.arms == 1 and driver.retries >= 2 and worker.busy_arms == 0
    finally:
        driver.close()


async def test_waiters_wake_after_the_progress_that_completed_their_request(worker: ScriptedWorker) -> None:
    driver = ArmedProgress(worker, asyncio.get_running_loop())
    try:
        done, failed = Request(), Request()
        failed.error = RuntimeError("endpoint reset")
        waiting = asyncio.ensure_future(driver.wait(done))
        waiting_failed = asyncio.ensure_future(driver.wait(failed))
        await asyncio.sleep(0.05)
        assert not waiting.done() and not waiting_failed.done()
        worker.on_progress += [done, failed]
        worker.event()
        await asyncio.wait_for(waiting, 1.0)
        with pytest.raises(RuntimeError, match="endpoint reset"):
            await asyncio.wait_for(waiting_failed, 1.0)
        already = Request()
        already.completed = True
        await asyncio.wait_for(driver.wait(already), 0.1)  # completed at posting: no wait at all
    finally:
        driver.close()


async def test_a_reset_context_gets_a_new_driver_and_the_old_one_stops_reading() -> None:
    app = importlib.import_module("ucxx._lib_async.application_context")
    loop = asyncio.get_running_loop()
    first, second = ScriptedWorker(), ScriptedWorker()
    ctx = types.SimpleNamespace(progress_mode="blocking", worker=first)
    fake = types.SimpleNamespace(core=types.SimpleNamespace(_get_ctx=lambda: ctx))
    try:
        d1 = install_armed_progress(fake)
        assert d1 is not None and install_armed_progress(fake) is d1
        ctx.worker = second  # ucxx.reset() and init(): a new worker
        d2 = install_armed_progress(fake)
        assert d2 is not None and d2 is not d1 and d2.worker is second
        assert app.ProgressTasks[loop] is d2
        progressed = first.progressed
        first.event()
        second.event()
        await asyncio.sleep(0.02)
        assert first.progressed == progressed  # the old driver's reader is gone
        assert d2.arms == 2
        ctx.progress_mode = "thread"
        assert install_armed_progress(fake) is None  # other modes keep ucxx's own progress
    finally:
        for d in (app.ProgressTasks.pop(loop, None),):
            if isinstance(d, ArmedProgress):
                d.close()
        first.close()
        second.close()
