"""NIXL worker and transfer bookkeeping under failure: releases that raise, a cancelled open, a stuck write."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Any

import anyio
import pytest

from aioembed_nixl._engine import Engine, _Peer, _Prepared, _Resources
from aioembed_nixl._loop import LoopWaker
from aioembed_nixl._worker import STALL_CAP, AgentWorker, Posted, WriteJob

from .conftest import NIXL_OPTIONS


class _Handle:
    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.released = 0

    def release(self) -> None:
        self.released += 1
        if self.fails:
            raise RuntimeError("NIXL_ERR_BACKEND")


def _engine_with(peer: _Peer) -> Engine:
    """The engine's bookkeeping, with no agent (as after teardown: metadata removal is not a NIXL call)."""
    engine = Engine.__new__(Engine)
    engine.name, engine.agent, engine._unreleased = "local-agent", None, []
    engine._peers = {peer.name: peer}
    return engine


def test_a_failing_list_release_still_counts_the_transfer_as_ended() -> None:
    peer = _Peer("peer-agent")
    engine = _engine_with(peer)
    peer.inflight = 1
    prepared = _Prepared(_Handle(), version=1)
    prepared.users, prepared.retired = 1, True  # the peer re-announced: the old list goes with its last user
    local, remote, xfer = _Handle(fails=True), _Handle(fails=True), _Handle()
    res = _Resources(engine, peer, xfer, local=local, own_remote=remote, prepared=prepared)
    posted = Posted(xfer, 64, check=lambda h: "DONE", release=res.release)
    res.release(posted, True)
    assert (xfer.released, local.released, remote.released) == (1, 1, 1)
    assert peer.inflight == 0 and not engine._peers  # the peer's metadata can go
    assert prepared.users == 0 and prepared.handle is None  # the retired list was released
    assert posted.handle is None
    assert [h for _, h in engine._unreleased] == [local, remote]  # kept for a retry, not dropped


def test_a_failing_transfer_release_is_not_retried(caplog: Any) -> None:
    peer = _Peer("peer-agent")
    engine = _engine_with(peer)
    peer.inflight = 1
    xfer = _Handle(fails=True)
    res = _Resources(engine, peer, xfer, local=None, own_remote=None, prepared=None)
    res.release(Posted(xfer, 64, check=lambda h: "DONE", release=res.release), True)
    assert getattr(xfer, "_released", False) and peer.inflight == 0
    assert "could not release a transfer handle" in caplog.text


@pytest.mark.anyio
async def test_a_cancelled_open_tears_down_the_agent_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioembed_nixl import _engine
    from aioembed_nixl.transport import NixlTransport

    started = threading.Event()
    made, torn = [], []
    real_init, real_teardown = _engine.Engine.__init__, _engine.Engine.teardown

    def slow_init(self: _engine.Engine, *args: Any) -> None:
        started.set()
        time.sleep(0.3)  # the caller is cancelled while the agent is being made
        real_init(self, *args)
        made.append(self.name)

    def teardown(self: _engine.Engine, worker: Any) -> None:
        torn.append(self.name)
        real_teardown(self, worker)

    monkeypatch.setattr(_engine.Engine, "__init__", slow_init)
    monkeypatch.setattr(_engine.Engine, "teardown", teardown)
    before = {t.name for t in threading.enumerate() if t.name.startswith("nixl-")}
    async with anyio.create_task_group() as tg:
        tg.start_soon(NixlTransport.open, dict(NIXL_OPTIONS))
        await anyio.to_thread.run_sync(started.wait)
        tg.cancel_scope.cancel()
    assert len(made) == 1 and torn == made  # torn down, not left to the garbage collector
    assert {t.name for t in threading.enumerate() if t.name.startswith("nixl-")} == before  # its thread ended


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_stuck_write_times_out_while_other_writes_to_its_peer_complete() -> None:
    """Progress of other writes to the peer keeps a write's deadline away (a burst queues behind itself), but
    not for ever: a transfer that never ends times out at STALL_CAP x write_timeout."""
    timeout = 0.05
    worker = AgentWorker("stall-test", LoopWaker())

    def post(state: str) -> Any:
        def run(job: WriteJob) -> None:
            job.posted.append(Posted(object(), 64, check=lambda h: state, release=lambda p, ended: None))
        return run

    stuck = WriteJob(post("PROC"), timeout, "stuck write", peer="peer")
    t0 = time.monotonic()
    try:
        async with anyio.create_task_group() as tg:
            async def others() -> None:  # writes to the same peer that complete, every 10 ms
                while True:
                    await worker.write(WriteJob(post("DONE"), timeout, "quick write", peer="peer"))
                    await anyio.sleep(0.01)

            tg.start_soon(others)
            worker._queue(stuck)  # nobody awaits it through write(): a cancelled waiter would wait shielded
            with anyio.fail_after(STALL_CAP * timeout + 5):
                await stuck.done.wait()
            tg.cancel_scope.cancel()
    finally:
        worker.stop()
        await worker.join()
    assert isinstance(stuck.error, TimeoutError) and "did not end within" in str(stuck.error)
    assert time.monotonic() - t0 >= STALL_CAP * timeout * 0.9
    assert stuck.timed_out and stuck.pending  # still in flight, still tracked


@pytest.mark.anyio
async def test_a_failed_worker_thread_never_settles_a_write_it_leaves_in_flight() -> None:
    """A write still in flight when the worker thread ends without a teardown (the thread failed) may still
    move: its waiter fails, but it is never settled (its memory stays fenced). It used to be settled on the
    way out, which also settled the writes of an endpoint dropped without ``aclose()`` (found by a review)."""
    class Bug(BaseException):
        pass

    worker = AgentWorker("abandon-test", LoopWaker())
    polls = 0

    def check(handle: Any) -> str:
        nonlocal polls
        polls += 1
        if polls > 3:
            raise Bug  # not an Exception: out of the poll loop, as a bug in it would go
        return "PROC"

    def post(job: WriteJob) -> None:
        job.posted.append(Posted(object(), 64, check=check, release=lambda p, ended: None))

    job = WriteJob(post, 10.0, "a write", peer="peer")
    with anyio.fail_after(5), pytest.raises(RuntimeError, match="in flight"):
        await worker.write(job)
    await worker.join()
    with anyio.move_on_after(0.2):
        await job.settled.wait()
    assert not job.settled.is_set(), "settled while the agent that moves it was never torn down"


@pytest.mark.anyio
async def test_a_finalizer_running_on_the_worker_thread_inside_its_loop_is_not_lost() -> None:
    """The finalizer of a dropped endpoint can run on the worker thread itself (an endpoint with a link is in a
    reference cycle, freed by the cyclic collector on whatever thread collects). Where it landed between the
    loop's taking and clearing of its queue, the teardown was cleared with it: never run, the thread ended
    and the writes in flight were never settled (found by a review; the collection made to happen there)."""
    worker = AgentWorker("finalizer-window", LoopWaker())
    torn_down: list[bool] = []
    moving = True

    def check(handle: Any) -> str:
        return "PROC" if moving else "DONE"

    def post(job: WriteJob) -> None:
        job.posted.append(Posted(object(), 64, check=check, release=lambda p, ended: None))

    def teardown() -> None:  # what the endpoint's finalizer queues: engine.teardown(worker)
        nonlocal moving
        for job in worker.drain_inflight("the endpoint closed"):
            moving = False
            worker.settle(job)
        torn_down.append(True)

    class GcInTheWindow(deque):  # type: ignore[type-arg]
        """``clear()`` is the next call after ``list(self._jobs)``: the collection runs just before it."""

        fired = False

        def clear(self) -> None:
            if not GcInTheWindow.fired and worker._inflight:
                GcInTheWindow.fired = True
                worker.stop_after(teardown)  # the finalizer, run by the GC on this thread (re-entrant lock)
            super().clear()

    worker._jobs = GcInTheWindow(worker._jobs)
    job = WriteJob(post, 30.0, "a write", peer="peer")
    with anyio.move_on_after(0.3), contextlib.suppress(RuntimeError):
        await worker.write(job)  # posted; fails once the endpoint is torn down (or its thread ends)
    with anyio.move_on_after(3):
        await job.settled.wait()
    await worker.join()
    assert GcInTheWindow.fired
    assert torn_down, "the dropped endpoint's teardown was lost: the agent lives on"
    assert job.settled.is_set(), "the write in flight is never settled"
