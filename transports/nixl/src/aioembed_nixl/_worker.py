"""The one thread of an endpoint that makes every NIXL call, and waits for transfers without spinning.

Why a thread, and only one: NIXL calls do real work on the calling thread. With UCX over TCP,
``transfer()`` copies into socket buffers (up to 17 ms for 64 MiB here) and ``check_xfer_state()``
progresses the worker (single calls up to 6 ms); over shared memory (``cma``) ``transfer()`` copies the
whole write before it returns (35 ms for 256 MiB). On the event loop that would stall every other
task. So each endpoint has one worker thread, owned by the endpoint and stopped by its ``aclose()``:
it runs jobs from a queue (register, connect, build-and-post a write, ...) in order, and polls the
transfers in flight with ``check_xfer_state``, backing off from 20 us to 1 ms while nothing completes
and sleeping on a condition (no timeout, no CPU) while nothing is in flight. New work wakes it at once.
A finished transfer wakes its waiter on the event loop through :class:`~aioembed_nixl._loop.LoopWaker`.
One thread, not one per transfer: hundreds of writes in flight cost one poll loop.

A transfer that passes its deadline fails its waiter but stays in flight here (NIXL cannot abort it:
see the README); it is polled every 50 ms until it ends, then released, and its lateness is logged.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import anyio

from aioembed_nixl._loop import LoopWaker

__all__ = ["AgentWorker", "CallJob", "Posted", "WriteJob"]

log = logging.getLogger("aioembed.transports.nixl")

T = TypeVar("T")

_POLL_FIRST = 20e-6
_POLL_MAX = 1e-3
_POLL_ORPHAN = 0.05
STALL_CAP = 10
"""A write whose transfers have not ended ``STALL_CAP x write_timeout`` after posting times out even while
other writes to its peer keep completing (a transfer NIXL stopped moving would otherwise never time out,
and a cancelled waiter of it would wait, shielded, for good)."""


class _Job:
    """Something the worker thread does for a task on the event loop, which awaits :attr:`done`."""

    def __init__(self) -> None:
        self.done = anyio.Event()  # created on the loop; set there (LoopWaker)
        self.error: BaseException | None = None
        self.resolved = False  # touched by the worker thread only


class CallJob(_Job, Generic[T]):
    """Run ``fn()`` on the worker thread."""

    def __init__(self, fn: Callable[[], T]) -> None:
        super().__init__()
        self.fn = fn
        self.result: T | None = None


def _undo_or_warn(undo: Callable[[T], object], result: T) -> None:
    """A queued undo nobody waits for: its failure is logged, not left on a job nobody reads."""
    try:
        undo(result)
    except Exception as exc:
        log.warning("nixl: undoing a call its cancelled caller no longer owns failed (%s: %s); what it "
                    "made is left to the endpoint's close", type(exc).__name__, exc)


class Posted:
    """One NIXL transfer posted by a write, and what to release once it has ended."""

    __slots__ = ("check", "ended", "handle", "nbytes", "release")

    def __init__(self, handle: Any, nbytes: int, check: Callable[[Any], str],
                 release: Callable[[Posted, bool], None]) -> None:
        self.handle = handle
        self.nbytes = nbytes
        self.check = check
        self.release = release
        """``release(posted, ended)``: free the handle and its lists (``ended``: it is DONE or failed)."""
        self.ended = False


class WriteJob(_Job):
    """Build and post a write's transfers on the worker thread (``post``), then wait for them.

    ``post(job)`` appends each transfer to :attr:`posted` as soon as it is posted, so a failure half way
    leaves the posted ones tracked. ``may_land`` tells the waiter whether anything was posted."""

    def __init__(self, post: Callable[[WriteJob], None], timeout: float, what: str, peer: str = "") -> None:
        super().__init__()
        self.post = post
        self.timeout = timeout
        self.deadline = 0.0  # set when posted
        self.what = what
        self.peer = peer
        """The destination agent: progress of any of its transfers keeps this write's deadline away."""
        self.posted: list[Posted] = []
        self.timed_out = False
        self.started_at = 0.0
        self.uncertain = False
        """A NIXL call raised while a transfer of it may have been moving (``transfer()`` or
        ``check_xfer_state()``): it may land, and its end cannot be seen."""
        self.settled = anyio.Event()  # created on the loop; set there once no transfer of it moves any more
        self.settled_known = False  # touched by the worker thread only

    @property
    def may_land(self) -> bool:
        return bool(self.posted) or self.uncertain

    async def wait_settled(self) -> None:
        """Until the worker saw the last transfer of this write end (``TransportError.settled``); if NIXL lost
        track of one of them (a call raised), ``timeout`` more: its end could not be seen."""
        await self.settled.wait()
        if self.uncertain:
            await anyio.sleep(self.timeout)

    @property
    def pending(self) -> list[Posted]:
        return [p for p in self.posted if not p.ended]


class AgentWorker:
    """The worker thread of one endpoint (see the module docstring)."""

    def __init__(self, name: str, waker: LoopWaker) -> None:
        self.name = name
        self._waker = waker
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._final: Callable[[], object] | None = None
        """What :meth:`stop_after` left to run once the queue is empty (kept apart from ``_jobs``: a finalizer
        may run on this very thread, between the loop's taking and its clearing of the queue)."""
        self._inflight: list[WriteJob] = []
        self._taken = 0
        """Jobs this thread took from the queue and has not finished (set under ``_cond`` when taken; cleared
        after, which only ever makes :meth:`call_if_idle` decline)."""
        self._uncertain_until = 0.0
        """``time.monotonic()`` until which a write NIXL lost track of may still move (a ``check_xfer_state``
        raised): no call on the event loop before then (it could wait behind that transfer)."""
        self._calls = threading.Lock()
        """Held by whichever thread makes NIXL calls of this endpoint's agent: this one, or the event loop's in
        :meth:`call_if_idle`."""
        self._progress: dict[str, float] = {}
        """Per destination agent: when a transfer to it last completed (while writes to it are in flight)."""
        self._stopping = False
        self.polls = 0
        """``check_xfer_state`` rounds so far (for tests of the idle cost)."""
        self._thread = threading.Thread(target=self._run, name=f"nixl-{name[-12:]}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def inflight(self) -> int:
        """Writes posted and not ended (those that timed out included)."""
        with self._cond:
            return len(self._inflight)

    # -- the event-loop side --------------------------------------------------------------

    async def call(self, fn: Callable[[], T], *, undo: Callable[[T], object] | None = None) -> T:
        """``fn()`` on the worker thread. Cancelling the caller withdraws a call that has not started;
        one that runs is waited for (NIXL state must match what the caller believes), and if it succeeded,
        ``undo(result)`` is queued after it (what it made would have no owner: a link's state, say)."""
        job: CallJob[T] = CallJob(fn)
        try:
            await self._run_job(job)
        except BaseException:
            if undo is not None and job.done.is_set() and job.error is None:
                result = cast("T", job.result)  # it succeeded: result is fn()'s
                self._queue(CallJob(functools.partial(_undo_or_warn, undo, result)))
            raise
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def call_if_idle(self, fn: Callable[[], object]) -> bool:
        """``fn()`` on the calling thread (the event loop's), if this thread has nothing queued, nothing under
        way and no transfer in flight: False (nothing run) otherwise. For quick calls (a registration that pins
        nothing): two hops to this thread and back cost 0.2-0.3 ms on a 2-core VM, the call itself 10 us. While
        it runs, this thread waits before any NIXL call of its own (NIXL blocks a registration behind a running
        transfer, so one is never made while a transfer may run). What ``fn`` raises propagates."""
        with self._cond:
            if self._jobs or self._taken or self._inflight or self._stopping \
                    or time.monotonic() < self._uncertain_until:
                return False
            if not self._calls.acquire(blocking=False):
                return False
        try:
            fn()
        finally:
            self._calls.release()
        return True

    def _queue(self, job: _Job) -> None:
        """Queue a job nobody waits for (dropped if the worker stopped: its teardown releases everything)."""
        with self._cond:
            if not self._stopping:
                self._jobs.append(job)
                self._cond.notify()

    async def write(self, job: WriteJob) -> None:
        """Post ``job`` and return once its transfers are DONE; raises what failed (the NIXL exception, or
        ``TimeoutError`` at the deadline). A write cancelled after posting is waited for (NIXL cannot abort
        it) until it ends or its deadline passes, so its source is never released while NIXL may read it."""
        await self._run_job(job)
        if job.error is not None:
            raise job.error

    async def _run_job(self, job: _Job) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"the NIXL worker of agent {self.name} has stopped")
            self._jobs.append(job)
            self._cond.notify()
        try:
            await job.done.wait()
        except BaseException:
            with self._cond:
                queued = job in self._jobs
                if queued:
                    self._jobs.remove(job)
            if not queued:
                with anyio.CancelScope(shield=True):
                    await job.done.wait()
            raise

    def stop(self) -> None:
        """Let the thread end once its queue is empty (queue the teardown before calling this)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def stop_after(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the thread, nobody waiting for it, then let the thread end: for an endpoint dropped
        without ``aclose()``, whose teardown must still run here before its writes in flight are settled.
        Needs no event loop (a garbage collector's finalizer calls it, from any thread); ignored once stopping."""
        with self._cond:
            if not self._stopping:
                self._final = fn
                self._stopping = True
                self._cond.notify()

    async def join(self) -> None:
        await anyio.to_thread.run_sync(self._thread.join)

    # -- the worker thread ----------------------------------------------------------------

    def _resolve(self, job: _Job, error: BaseException | None = None) -> None:
        if job.resolved:
            return
        job.resolved = True
        job.error = error
        self._waker.call_soon(job.done.set)

    def _settle(self, job: WriteJob) -> None:
        """No transfer of ``job`` moves any more: its waiter (the sender's fencing) may stop waiting."""
        if job.settled_known:
            return
        job.settled_known = True
        self._waker.call_soon(job.settled.set)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # a bug here must not leave waiters hanging
            log.exception("nixl agent %s: the worker thread failed", self.name)
        finally:
            with self._cond:
                self._stopping = True
            self._abandon()

    def _loop(self) -> None:
        delay = _POLL_FIRST
        while True:
            with self._cond:
                while not self._jobs and not self._inflight and not self._stopping:
                    self._cond.wait()  # idle: nothing queued, nothing in flight
                if not self._jobs and self._inflight:
                    self._cond.wait(delay)  # back off; new work wakes us at once
                jobs = list(self._jobs)
                self._jobs.clear()
                self._taken = len(jobs)
                stopping = self._stopping
            with self._calls:
                for job in jobs:
                    self._start(job)
                moved = self._poll(time.monotonic()) if self._inflight else False
            self._taken = 0
            if stopping and not jobs:
                with self._cond:
                    if self._jobs:
                        continue
                    final, self._final = self._final, None
                    if final is None:
                        break
                if final is not None:
                    with self._calls:
                        self._run_final(final)
                    continue
            waited = any(not j.resolved for j in self._inflight)
            delay = _POLL_FIRST if moved or jobs else min(2 * delay, _POLL_MAX if waited else _POLL_ORPHAN)
        self._abandon()

    def _run_final(self, fn: Callable[[], object]) -> None:
        """What :meth:`stop_after` left (nobody waits for it)."""
        try:
            fn()
        except Exception:
            log.exception("nixl agent %s: a job nobody waits for failed", self.name)

    def _start(self, job: _Job) -> None:
        if isinstance(job, CallJob):
            try:
                job.result = job.fn()
            except BaseException as exc:
                self._resolve(job, exc)
            else:
                self._resolve(job)
            return
        assert isinstance(job, WriteJob)
        job.started_at = time.monotonic()
        job.deadline = job.started_at + job.timeout
        try:
            job.post(job)
        except BaseException as exc:
            self._resolve(job, exc)  # the ones posted before the failure stay tracked below
        if job.pending:
            self._inflight.append(job)
            return
        if not job.resolved:
            self._resolve(job)  # every transfer completed inside transfer() (e.g. shared memory)
        self._settle(job)

    def _poll(self, now: float) -> bool:
        """One look at every transfer in flight; True if any ended."""
        self.polls += 1
        moved = False
        still: list[WriteJob] = []
        for job in self._inflight:
            error: BaseException | None = None
            for p in job.pending:
                try:
                    state = p.check(p.handle)
                except Exception as exc:
                    state, error = "ERR", exc
                    job.uncertain = True  # NIXL lost track of it (NOT_FOUND while its bytes land, ...)
                    self._uncertain_until = max(self._uncertain_until, now + job.timeout)
                if state == "PROC":
                    continue
                if state != "DONE" and error is None:
                    error = RuntimeError(f"check_xfer_state returned {state!r}")
                if state == "DONE":
                    self._progress[job.peer] = now
                p.ended = True
                moved = True
                try:
                    p.release(p, True)
                except Exception as exc:
                    log.warning("nixl agent %s: releasing a finished transfer of %s failed: %s: %s", self.name,
                                job.what, type(exc).__name__, exc)
            if error is not None:
                self._resolve(job, error)
            if job.pending:
                # Writes to one peer share its link: while any of them completes, the link moves, and a
                # write queued behind others is not late (a burst timed out writes with 6x headroom).
                stalled = now >= self._progress.get(job.peer, 0.0) + job.timeout
                capped = now >= job.started_at + STALL_CAP * job.timeout
                if not job.resolved and now >= job.deadline and (stalled or capped):
                    job.timed_out = True
                    self._resolve(job, TimeoutError(
                        f"{job.what} made no progress within write_timeout={job.timeout} s" if stalled else
                        f"{job.what} did not end within {STALL_CAP} x write_timeout={job.timeout} s, while other "
                        "writes to its peer did"))
                still.append(job)
            else:
                if job.timed_out:
                    log.warning("nixl agent %s: %s ended %.2f s after its deadline (it could not be cancelled)",
                                self.name, job.what, now - job.deadline)
                self._resolve(job)
                self._settle(job)
        self._inflight = still
        if not still:
            self._progress.clear()
        return moved

    def _abandon(self) -> None:
        """At exit: fail what is left. A write still in flight here was not drained by a teardown (this thread
        failed), so its agent may still move it: it is never settled, and its memory stays fenced."""
        if self._inflight:
            log.warning("nixl agent %s: the worker thread ended with %d write(s) in flight and the agent not torn "
                        "down; they are never settled (their memory stays fenced)", self.name, len(self._inflight))
        for write in self._inflight:
            self._resolve(write, RuntimeError(f"the endpoint closed with {write.what} in flight"))
        self._inflight = []
        with self._cond:
            queued = list(self._jobs)
            self._jobs.clear()
        for job in queued:
            self._resolve(job, RuntimeError(f"the NIXL worker of agent {self.name} has stopped"))

    def drain_inflight(self, reason: str) -> list[WriteJob]:
        """Called by the teardown job (on this thread): fail every write still in flight and return it, for
        the teardown to release its transfers and destroy the agent, and only then :meth:`settle` it."""
        jobs, self._inflight = self._inflight, []
        for job in jobs:
            self._resolve(job, RuntimeError(f"{reason} with {job.what} in flight"))
        return jobs

    def settle(self, job: WriteJob) -> None:
        """For the teardown, once the agent that moved ``job`` is destroyed."""
        self._settle(job)
