"""Quick NIXL calls made on the event loop while the endpoint's worker thread is idle (``call_if_idle``), and
never while it has work: NIXL blocks a registration behind a running transfer."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from aioembed.transports.base import MemoryRegion

from aioembed_nixl import NixlTransport
from aioembed_nixl._loop import LoopWaker
from aioembed_nixl._worker import AgentWorker, CallJob, Posted, WriteJob

from .conftest import NIXL_OPTIONS

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def _worker() -> AsyncIterator[AgentWorker]:
    worker = AgentWorker("calls-test", LoopWaker())
    try:
        yield worker
    finally:
        worker.stop()
        await worker.join()


async def _runs_here_once_idle(worker: AgentWorker, fn: Callable[[], object]) -> None:
    """``fn`` runs on this thread once the worker is idle again (bounded): the thread resolves a job, then clears
    what it took, so right after a job's result came it may still decline, which is by design."""
    with anyio.fail_after(5):
        while not worker.call_if_idle(fn):
            await anyio.sleep(0.001)


async def test_an_idle_worker_lets_the_call_run_on_the_calling_thread() -> None:
    async with _worker() as worker:
        ran: list[int] = []
        assert worker.call_if_idle(lambda: ran.append(threading.get_ident()))
        assert ran == [threading.get_ident()]
        # and again: the lock was given back
        assert worker.call_if_idle(lambda: ran.append(threading.get_ident()))
        assert len(ran) == 2


async def test_a_job_under_way_or_queued_keeps_the_call_on_the_worker() -> None:
    async with _worker() as worker:
        release = threading.Event()
        started = threading.Event()

        def blocking() -> None:
            started.set()
            release.wait(5)

        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.call, blocking)
            await anyio.to_thread.run_sync(started.wait, 5)
            ran: list[str] = []
            assert not worker.call_if_idle(lambda: ran.append("under way"))  # a job is running
            tg.start_soon(worker.call, lambda: None)
            await anyio.sleep(0.01)
            assert not worker.call_if_idle(lambda: ran.append("queued"))  # and one is queued behind it
            release.set()
        assert ran == []
        await _runs_here_once_idle(worker, lambda: ran.append("idle"))
        assert ran == ["idle"]


async def test_a_write_in_flight_keeps_the_call_on_the_worker() -> None:
    async with _worker() as worker:
        moving = True

        def post(job: WriteJob) -> None:
            job.posted.append(Posted(object(), 64, check=lambda h: "PROC" if moving else "DONE",
                                     release=lambda p, ended: None))

        async with anyio.create_task_group() as tg:
            job = WriteJob(post, 10.0, "a write", peer="peer")
            tg.start_soon(worker.write, job)
            with anyio.fail_after(5):
                while not worker.inflight:
                    await anyio.sleep(0.001)
            assert not worker.call_if_idle(lambda: pytest.fail("ran while a transfer was in flight"))
            moving = False
        assert job.done.is_set() and job.error is None
        await _runs_here_once_idle(worker, lambda: None)


async def test_a_stopping_worker_runs_nothing_here() -> None:
    worker = AgentWorker("calls-stop", LoopWaker())
    worker.stop()
    await worker.join()
    assert not worker.call_if_idle(lambda: pytest.fail("ran on a stopped worker"))


async def test_the_worker_waits_for_a_call_running_here() -> None:
    """A job queued while a call runs on the loop thread starts only once that call returned: their NIXL calls
    never overlap."""
    async with _worker() as worker:
        marks: list[tuple[str, float]] = []
        job: CallJob[None] = CallJob(lambda: marks.append(("job", time.monotonic())))

        def here() -> None:
            worker._queue(job)  # the worker wakes for it while this still runs
            time.sleep(0.05)
            marks.append(("here", time.monotonic()))

        assert worker.call_if_idle(here)
        with anyio.fail_after(5):
            await job.done.wait()
        assert [name for name, _ in marks] == ["here", "job"]


async def test_what_the_call_raises_reaches_the_caller_and_frees_the_worker() -> None:
    async with _worker() as worker:
        def boom() -> None:
            raise RuntimeError("NIXL_ERR_BACKEND")

        with pytest.raises(RuntimeError, match="NIXL_ERR_BACKEND"):
            worker.call_if_idle(boom)
        assert await worker.call(lambda: 7) == 7
        await _runs_here_once_idle(worker, lambda: None)


async def test_a_registration_runs_here_when_idle_and_on_the_worker_while_a_call_runs_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU memory, UCX and no RDMA device on this machine: registering pins nothing, so an idle endpoint
    registers and unregisters on the event loop; a busy one on its worker thread."""
    import torch

    transport = await NixlTransport.open(NIXL_OPTIONS)
    try:
        threads: list[str] = []
        engine: Any = transport._engine
        real_register, real_deregister = engine.register, engine.deregister

        def register(regions: Any) -> None:
            threads.append(threading.current_thread().name)
            real_register(regions)

        def deregister(regions: Any) -> None:
            threads.append(threading.current_thread().name)
            real_deregister(regions)

        monkeypatch.setattr(engine, "register", register)
        monkeypatch.setattr(engine, "deregister", deregister)
        buf = torch.zeros(4096, dtype=torch.uint8)
        region = MemoryRegion.of_tensor(buf)
        # Right after open() the worker may still be clearing its start-up job (it declines until then, by
        # design): wait, bounded, until it is idle (CI caught the race once).
        await _runs_here_once_idle(transport.worker, lambda: None)
        await transport.register([region])
        await transport.unregister([region])
        assert threads == [threading.current_thread().name] * 2

        release = threading.Event()
        started = threading.Event()

        def busy() -> None:
            started.set()
            release.wait(5)

        threads.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(transport.worker.call, busy)
            await anyio.to_thread.run_sync(started.wait, 5)
            tg.start_soon(transport.register, [region])
            await anyio.sleep(0.02)
            assert threads == []  # queued behind the busy job, not run here
            release.set()
        assert threads and threads[0] != threading.current_thread().name
        await transport.unregister([region])
        assert transport.regions.covers(region.address, region.length) is False
    finally:
        await transport.aclose()


async def test_a_write_nixl_lost_track_of_keeps_calls_on_the_worker_for_its_timeout() -> None:
    """A ``check_xfer_state`` that raised leaves a transfer that may still move: a registration on the event loop
    could wait behind it, so calls stay on the worker until that write's timeout has passed."""
    async with _worker() as worker:
        def check(handle: Any) -> str:
            raise RuntimeError("NIXL_ERR_NOT_FOUND")

        def post(job: WriteJob) -> None:
            job.posted.append(Posted(object(), 64, check=check, release=lambda p, ended: None))

        timeout = 0.3
        with pytest.raises(RuntimeError, match="NOT_FOUND"):
            await worker.write(WriteJob(post, timeout, "a write", peer="peer"))
        assert not worker.call_if_idle(lambda: pytest.fail("ran while a lost transfer may still move"))
        await anyio.sleep(timeout + 0.05)
        await _runs_here_once_idle(worker, lambda: None)
