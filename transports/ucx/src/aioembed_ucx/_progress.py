"""Driving the UCX worker from the asyncio loop in ``blocking`` mode, idle at no CPU cost.

UCX's event-driven pattern is: progress the worker, ``arm`` it (which fails while events are still
unprocessed: progress and try again), then sleep on the worker's epoll file descriptor until it
fires, and start over. ucxx 0.52's ``BlockingMode`` arms the worker once at start-up, and its fd
callback only progresses: it never arms the worker again. After the first event the descriptor
stays readable, the loop calls the callback on every turn, and an idle process spins at 1 CPU-s/s
(measured here: sender and receiver in two processes, each at 0.99-1.0 CPU-s/s with no transfer in
flight). On a 2-core host that spinning also stole the cores that transfers needed: 64-token
requests took 6.4 ms one at a time in a process that had a second, idle ucxx endpoint, against 2 ms
without it.

:class:`ArmedProgress` takes ucxx's place for the running loop (ucxx starts no progress task of its
own for a loop that already has one): the fd callback progresses and re-arms, retrying on the next
loop turn while the worker stays busy, and a safety timer progresses the worker once a second in
case an event never reaches the descriptor (ucxx keeps the same guard).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import importlib
import logging
import time
import types
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from aioembed_ucx._graveyard import GRAVEYARD

__all__ = ["ArmedProgress", "Posted", "bury_posted", "cancel_posted", "close_at_once", "close_posted",
           "install_armed_progress", "kick", "post", "settle_graveyard", "tag_recv", "tag_send", "wait_posted",
           "wait_request"]

log = logging.getLogger("aioembed.transports.ucx")

_ARM_TRIES = 8
"""Progress-and-arm attempts in one callback before yielding to the loop (events keep arriving)."""
_SAFETY_SECONDS = 1.0
"""The worker is progressed at least this often, whatever the descriptor says."""


class ArmedProgress:
    """Progress for one ucxx worker on one asyncio loop (see the module docstring)."""

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop, *, replaced: Any = None) -> None:
        self.worker = worker
        self.loop = loop
        self._replaced = replaced  # ucxx's progress object for this loop, stopped (see install_armed_progress)
        self.arms = 0
        """Successful arms (each one is a sleep on the descriptor)."""
        self.retries = 0
        """Loop turns on which the worker was still busy after :data:`_ARM_TRIES` attempts."""
        self._retry: asyncio.Handle | None = None
        self._last = time.monotonic()
        self._progressed = asyncio.Event()  # set (and replaced) after every progress: waiters look again
        worker.init_blocking_progress_mode()
        self._fd = int(worker.epoll_file_descriptor)
        loop.add_reader(self._fd, self._on_event)
        self._safety: asyncio.TimerHandle | None = loop.call_later(_SAFETY_SECONDS, self._on_safety)
        self._closed = False
        self._progress_and_arm()

    def _on_event(self) -> None:
        self._progress_and_arm()

    def _progress_and_arm(self) -> None:
        if self._closed:
            return
        self._retry = None
        self._last = time.monotonic()
        try:
            for _ in range(_ARM_TRIES):
                self.worker.progress()
                if self.worker.arm():
                    self.arms += 1
                    return
        finally:
            self._progressed.set()
            self._progressed = asyncio.Event()
        # Still busy: let the tasks that the completions woke run first, then try again.
        self.retries += 1
        if self._retry is None:
            self._retry = self.loop.call_soon(self._progress_and_arm)

    async def wait(self, request: Any) -> None:
        """Until ``request`` (a ucxx request) completed; raises its error. Completions happen only inside
        the worker's progress, so this looks at the request once after each progress, never in a loop of
        its own (ucxx's ``wait_yield`` polls every loop turn: one core per pending request)."""
        while not request.completed:
            await self._progressed.wait()
        request.check_error()

    def kick(self) -> None:
        """New work was posted on this worker, or an endpoint aborted: progress it (and arm again) on the
        next loop turn, once for all of this turn. UCX may leave part of it for progress (a rendezvous
        reply to a message that arrived before its receive was posted, a send the socket could not take
        at once, the closing of an aborted endpoint), and an armed worker's descriptor does not fire for
        that."""
        if self._retry is None and not self._closed:
            self._retry = self.loop.call_soon(self._progress_and_arm)

    async def wait_all(self, requests: list[Any], on_done: Callable[[], None] | None = None) -> None:
        """Until every request completed, in the calling task; ``on_done()`` after each one (in order of
        noticing). Raises the first error seen (the rest stay posted: the caller aborts the endpoint)."""
        pending = requests
        while pending:
            still = []
            for request in pending:
                if request.completed:
                    request.check_error()
                    if on_done is not None:
                        on_done()
                else:
                    still.append(request)
            pending = still
            if pending:
                await self._progressed.wait()

    def _on_safety(self) -> None:
        if self._closed:
            return
        if time.monotonic() - self._last >= _SAFETY_SECONDS:
            self._progress_and_arm()
        self._safety = self.loop.call_later(_SAFETY_SECONDS, self._on_safety)

    def close(self) -> None:
        """Stop driving the worker (the loop is closing, or ucxx is reset)."""
        if self._closed:
            return
        self._closed = True
        for handle in (self._retry, self._safety):
            if handle is not None:
                handle.cancel()
        if not self.loop.is_closed():
            self.loop.remove_reader(self._fd)


def install_armed_progress(ucxx: Any) -> ArmedProgress | None:
    """Make the running loop's UCX progress an :class:`ArmedProgress` if ucxx runs in ``blocking`` mode
    and has not started progress for this loop yet; returns the loop's driver (``None`` in the other
    modes, or when ucxx's own task already runs)."""
    ctx = ucxx.core._get_ctx()
    if ctx.progress_mode != "blocking":
        return None
    app = importlib.import_module("ucxx._lib_async.application_context")
    loop = asyncio.get_running_loop()
    _forget_closed_loops(app.ProgressTasks)
    have = app.ProgressTasks.get(loop)
    if isinstance(have, ArmedProgress) and have.worker is ctx.worker:
        return have
    # ucxx was reset (after a fork): its new context cleared ucxx's table and started a new progress
    # object, while the driver of the old worker still reads on this loop.
    old = _DRIVERS.pop(loop, None)
    if old is not None:
        old.close()
    if have is not None and not isinstance(have, ArmedProgress):
        _stop_ucxx_progress(have, loop, ctx.worker)
    driver = ArmedProgress(ctx.worker, loop, replaced=have)
    app.ProgressTasks[loop] = _DRIVERS[loop] = driver
    return driver


_DRIVERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ArmedProgress] = weakref.WeakKeyDictionary()
"""The driver of each loop, beside ucxx's table (which a reset clears)."""


def _forget_closed_loops(progress_tasks: dict[Any, Any]) -> None:
    """Drop the drivers of event loops that have closed (a process that runs ``asyncio.run`` per job):
    ucxx's table holds each loop, and its driver, for good otherwise."""
    for loop in [lp for lp in progress_tasks if isinstance(lp, asyncio.AbstractEventLoop) and lp.is_closed()]:
        driver = progress_tasks.pop(loop)
        _DRIVERS.pop(loop, None)
        if isinstance(driver, ArmedProgress):
            driver.close()


def _stop_ucxx_progress(task: Any, loop: asyncio.AbstractEventLoop, worker: Any) -> None:
    """Stop ucxx's ``BlockingMode`` (its context starts one for the loop it is created on): its fd
    reader and its two tasks. The object itself is kept alive by the driver that replaces it, because
    its finalizer removes whatever reader the worker's descriptor has."""
    loop.remove_reader(int(worker.epoll_file_descriptor))
    for name in ("arm_task", "progress_task"):
        t = getattr(task, name, None)
        if t is not None:
            t.cancel()


@functools.cache
def _ucxx() -> types.SimpleNamespace:
    """The ucxx internals the waits below use, resolved once (the same ones ``Endpoint.send``/``recv`` use)."""
    libucxx = importlib.import_module("ucxx._lib.libucxx")
    ucxx_types = importlib.import_module("ucxx.types")
    return types.SimpleNamespace(
        app=importlib.import_module("ucxx._lib_async.application_context"),
        Array=importlib.import_module("ucxx._lib.arr").Array,
        Tag=ucxx_types.Tag, TagMaskFull=ucxx_types.TagMaskFull,
        hash64bits=importlib.import_module("ucxx._lib_async.utils").hash64bits,
        UCXCloseError=libucxx.UCXCloseError,
        UCXCanceledError=libucxx.UCXCanceledError,
    )


def kick() -> None:
    """:meth:`ArmedProgress.kick` for the running loop's driver, if it has one."""
    driver = _driver()
    if driver is not None:
        driver.kick()


def close_at_once(endpoint: Any) -> None:
    """Close a raw ucxx endpoint with nothing posted on it (or one that failed), now; from any thread."""
    with contextlib.suppress(Exception):
        endpoint.close_blocking(period=10**8, max_attempts=1)
    with contextlib.suppress(RuntimeError):  # no running loop here (ucxx's progress thread)
        kick()  # the peer learns at once that the connection ended


def close_posted(endpoint: Any) -> Any:
    """Start closing a live raw ucxx endpoint that may have a stream receive posted (a peer-info exchange given
    up); the close request (await it with :func:`wait_request`), or ``None`` where the endpoint had failed
    already (then closed at once). Call it once per endpoint, never after it was closed: on an endpoint
    already closing ucxx returns an empty request, which crashes when dropped.

    Not ``close_blocking``: that cancels the endpoint's requests before it closes the endpoint, and UCX cannot
    cancel a stream receive (only closing the endpoint completes it), so ucxx kept the receive among the
    requests it was cancelling, inside the endpoint, and the receive holds its endpoint: a cycle that nothing
    broke. The endpoint lived for good, and one accepted by a listener kept ucxx's listener, and its port,
    listening after the owner closed. The close request closes the endpoint first, which completes the
    receive, and the endpoint is freed once nothing of ours holds it."""
    try:
        alive = bool(endpoint.alive)
    except Exception:
        alive = False
    if not alive:  # failed: UCX ended what was posted on it; nothing waits on a close request
        close_at_once(endpoint)
        return None
    request = endpoint.close()
    if not request.ucxx_ptr:
        # Already closing (a close raced in: ucxx's error handling on its progress thread, or a second call):
        # ucxx returned an empty request, whose wrapper crashes the process when it is deallocated, even by the
        # interpreter's shutdown: never let it be (one reference more, never given back).
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(request))
        return None
    with contextlib.suppress(RuntimeError):
        kick()  # the close is done in the worker's progress: now, and the peer learns at once
    return request


async def wait_request(request: Any) -> None:
    """Until a raw ucxx request completed (raises its error): through the loop's :class:`ArmedProgress`
    when it has one (ucxx's own ``wait`` polls on every loop turn: a core for as long as it is pending)."""
    driver = _driver()
    if driver is None:
        await request.wait()
    else:
        driver.kick()  # it was just posted: UCX may need a progress for it that no event announces
        await driver.wait(request)


def _driver() -> ArmedProgress | None:
    have = _ucxx().app.ProgressTasks.get(asyncio.get_running_loop())
    return have if isinstance(have, ArmedProgress) else None


def _posting(ep: Any, buffer: Any, tag: Hashable, which: str) -> tuple[Any, Any, Any]:
    """The raw endpoint, buffer and tag of ``ep.send``/``ep.recv`` (the same tag hashing: the peer may
    use ucxx's own calls)."""
    u = _ucxx()
    raw = ep._ep
    if raw is None:
        raise u.UCXCloseError("Endpoint closed")
    raw.raise_on_error()
    if ep.closed:
        raise u.UCXCloseError("Endpoint closed")
    if not isinstance(buffer, u.Array):
        buffer = u.Array(buffer)
    return raw, buffer, u.Tag(u.hash64bits(ep._tags[which], hash(tag)))


async def tag_send(ep: Any, buffer: Any, tag: Hashable) -> None:
    """``await ep.send(buffer, tag=tag)``, awaited through the loop's :class:`ArmedProgress` when it has one."""
    await _tagged(ep, buffer, tag, send=True)


async def tag_recv(ep: Any, buffer: Any, tag: Hashable) -> None:
    """``await ep.recv(buffer, tag=tag)``, awaited through the loop's :class:`ArmedProgress` when it has one."""
    await _tagged(ep, buffer, tag, send=False)


def _post_raw(driver: ArmedProgress | None, ep: Any, buffer: Any, tag: Hashable, send: bool) -> tuple[Any, Any]:
    """Post through the raw endpoint (the request and the ucxx buffer it uses); with an :class:`ArmedProgress`,
    progress follows on the loop's next turn (:meth:`ArmedProgress.kick`).

    In every progress mode, not only with an :class:`ArmedProgress`: ucxx's own ``ep.send``/``ep.recv`` keep
    the request inside their coroutine, so a caller that stopped waiting could not tell whether UCX was done
    with the buffer, and the graveyard could only wait out a grace period after the endpoint's abort (which in
    ``thread`` mode may return with receives still posted: see :mod:`aioembed_ucx._graveyard`)."""
    raw, buf, t = _posting(ep, buffer, tag, "msg_send" if send else "msg_recv")
    request = raw.tag_send(buf, t) if send else raw.tag_recv(buf, t, _ucxx().TagMaskFull)
    if driver is not None:
        driver.kick()
    return request, buf


async def _wait_raw(request: Any) -> None:
    """Until a request posted by :func:`_post_raw` completed, without an :class:`ArmedProgress` (ucxx's
    ``wait``: its Python future in ``thread`` mode, a poll per loop turn in ``polling``); raises its error."""
    await request.wait()
    request.check_error()


async def _tagged(ep: Any, buffer: Any, tag: Hashable, *, send: bool) -> None:
    driver = _driver()
    request, buf = _post_raw(driver, ep, buffer, tag, send)
    try:
        await (_wait_raw(request) if driver is None else driver.wait(request))
    except BaseException:
        GRAVEYARD.bury_posted(ep, [(buf, request)])  # abandoned while posted (unless completed): kept until UCX is done
        raise


class Posted:
    """One tag message posted on an endpoint: the ucxx request and the buffer it reads or fills (a ucxx
    ``Array``, whose ``obj`` is the object that owns the memory: it keeps that alive), and, in progress modes
    without an :class:`ArmedProgress`, the task that waits for the request."""

    __slots__ = ("buffer", "future", "request")

    def __init__(self, request: Any, buffer: Any, future: asyncio.Future[Any] | None) -> None:
        self.request = request
        self.buffer = buffer
        self.future = future


def post(ep: Any, buffer: Any, tag: Hashable, *, send: bool) -> Posted:
    """Post a tag send or receive now, in this order relative to other posts, without a task (but, in progress
    modes without an :class:`ArmedProgress`, the one that waits for it): several messages of one write are then
    awaited together by :func:`wait_posted` in the caller's task."""
    driver = _driver()
    request, buf = _post_raw(driver, ep, buffer, tag, send)
    return Posted(request, buf, None if driver is not None else asyncio.ensure_future(_wait_raw(request)))


async def wait_posted(posted: Sequence[Posted], on_done: Callable[[], None] | None = None) -> None:
    """Until every posted message completed; ``on_done()`` after each. Raises the first error seen. A cancelled
    wait leaves them posted and can be repeated."""
    requests = [p.request for p in posted if p.future is None]
    if requests:
        driver = _driver()
        assert driver is not None, "posted through an ArmedProgress that is gone"
        await driver.wait_all(requests, on_done)
    futures = [p.future for p in posted if p.future is not None]
    if futures:
        if on_done is not None:
            for f in futures:  # as the armed path: progress is a message that completed, not one that failed
                f.add_done_callback(lambda f: on_done() if not f.cancelled() and f.exception() is None else None)
        # Not gather: a cancelled wait leaves the messages waited for, so that it can be waited again.
        await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        for f in futures:
            if f.cancelled():  # by cancel_posted: not the waiter's cancellation (a wait again would spin)
                raise _ucxx().UCXCanceledError("a posted message was cancelled")
            if f.done() and (exc := f.exception()) is not None:
                raise exc


def cancel_posted(posted: Sequence[Posted]) -> None:
    """Stop waiting for messages still pending (their UCX requests stay posted until the endpoint is
    aborted, as after a cancelled :func:`tag_recv`; whoever gives them up buries them: :func:`bury_posted`)."""
    for p in posted:
        if p.future is not None:
            p.future.cancel()


def bury_posted(ep: Any, posted: Sequence[Posted]) -> None:
    """Keep the buffers of messages given up while posted until UCX completed or cancelled their requests."""
    GRAVEYARD.bury_posted(ep, [(p.buffer, p.request) for p in posted])


async def settle_graveyard(timeout: float) -> None:
    """An owner closes (its endpoints aborted): wait, at most ``timeout`` seconds, until UCX completed or
    cancelled every buried request, then keep what it did not for good (see :mod:`aioembed_ucx._graveyard`),
    so that no request kept past the close keeps an endpoint, or the owner's listener, alive. Usually the
    requests end within milliseconds of the aborts (``thread`` mode: on ucxx's progress thread)."""
    try:
        async with asyncio.timeout(timeout):
            for request in GRAVEYARD.posted_requests():
                try:
                    await wait_request(request)
                except Exception as exc:  # cancelled, or failed with its endpoint: either way UCX is done
                    log.debug("ucx: a buried request ended with %r", exc)
    except TimeoutError:
        pass  # what is still posted is kept for good just below, and said at WARNING
    GRAVEYARD.keep_posted_for_good(timeout)
