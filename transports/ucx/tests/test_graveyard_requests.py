"""The graveyard lets a buffer buried with its request go on UCX's word (the request completed or was cancelled),
never holds a completed request, and an owner's close leaves no request in it.

In ucxx's ``thread`` progress mode an abort after the peer's failure returns with receives still posted (ucxx
only schedules their cancellation on its progress thread; measured with ucxx 0.52: 50 of 50 aborts, cancelled
~1 ms later). A ucxx request takes no weak reference and ucxx keeps no reference to it, so the graveyard keeps
the request itself, and drops it once completed: a kept request keeps its endpoint, and that one the listener
it came from (test_listener_close.py)."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap
import weakref

import anyio
import pytest

from aioembed_ucx._graveyard import Graveyard

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Endpoint:
    alive = False  # aborted


class _Request:
    def __init__(self) -> None:
        self.completed = False


class _Owned(bytearray):
    """A bytearray that can be watched with a weak reference."""


def test_a_buffer_stays_while_its_request_is_posted_and_goes_with_it_once_completed() -> None:
    yard = Graveyard()
    request, scratch = _Request(), _Owned(64)
    buffer_gone, request_gone = weakref.ref(scratch), weakref.ref(request)
    yard.bury_posted(_Endpoint(), [(scratch, request)])
    del scratch
    for now in (1000.0, 1000.0 + 3 * Graveyard.GRACE, 1000.0 + 10 * Graveyard.GRACE):
        yard.prune(now)
        gc.collect()
        assert buffer_gone() is not None and len(yard) == 1  # UCX may still fill it, however long after the abort
    request.completed = True  # completed or cancelled: UCX is done with the buffer
    del request
    yard.prune(1000.0 + 10 * Graveyard.GRACE)
    gc.collect()
    assert len(yard) == 0 and buffer_gone() is None and request_gone() is None  # no grace period, no request kept


def test_a_request_completed_before_its_burial_keeps_nothing() -> None:
    yard = Graveyard()
    request = _Request()
    request.completed = True
    yard.bury_posted(_Endpoint(), [(bytearray(8), request)])
    assert len(yard) == 0


def test_a_request_whose_state_cannot_be_read_keeps_its_buffer() -> None:
    class Broken:
        @property
        def completed(self) -> bool:
            raise RuntimeError("request gone")

    yard = Graveyard()
    yard.bury_posted(_Endpoint(), [(bytearray(8), Broken())])
    yard.prune(1000.0 + 10 * Graveyard.GRACE)
    assert len(yard) == 1


def test_an_owners_close_keeps_what_is_still_posted_for_good_and_lets_go_of_requests_and_endpoints(
        caplog: pytest.LogCaptureFixture) -> None:
    yard = Graveyard()
    endpoint, request, done = _Endpoint(), _Request(), _Request()
    endpoint.alive = True
    endpoint_gone, request_gone = weakref.ref(endpoint), weakref.ref(request)
    posted, handshake = _Owned(100), _Owned(16)
    yard.bury_posted(endpoint, [(posted, request), (bytearray(50), done)])
    yard.bury(endpoint, handshake)  # no request: the endpoint's end and the grace period say when it goes
    done.completed = True
    del endpoint, request
    with caplog.at_level(logging.WARNING, logger="aioembed.transports.ucx"):
        yard.keep_posted_for_good(5.0)
    gc.collect()
    assert yard.kept_for_good == [posted] and request_gone() is None
    assert not yard.posted_requests()
    assert [b for _, held, _ in yard._entries for b, _ in held] == [handshake]
    assert any("1 posted messages (100 bytes)" in r.getMessage() for r in caplog.records)
    endpoint_alive = endpoint_gone()
    assert endpoint_alive is not None  # the handshake's endpoint is still alive: kept for its buffer
    endpoint_alive.alive = False
    del endpoint_alive
    yard.prune(1000.0)
    gc.collect()
    assert endpoint_gone() is None  # dead: let go at once, its buffer waits out the grace period


async def test_a_close_waits_for_buried_requests_at_most_its_timeout_then_keeps_their_buffers_for_good(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``settle_graveyard`` (an owner's close) lets go of the requests UCX completed while it waited, and keeps the
    buffers of one that never completes for good, without its request."""
    import asyncio

    from aioembed_ucx import _progress

    class Request(_Request):
        """Completed by UCX (here: a timer), whether or not anyone waits."""

        def __init__(self) -> None:
            super().__init__()
            self.ends = asyncio.Event()

        def end(self) -> None:
            self.completed = True
            self.ends.set()

        async def wait(self) -> None:  # what wait_request awaits without an ArmedProgress
            await self.ends.wait()

        def check_error(self) -> None:
            pass

    yard = Graveyard()
    monkeypatch.setattr(_progress, "GRAVEYARD", yard)
    monkeypatch.setattr(_progress, "_driver", lambda: None)
    stuck, late, ending = _Owned(32), _Owned(8), Request()
    late_gone = weakref.ref(late)
    yard.bury_posted(_Endpoint(), [(stuck, Request()), (late, ending)])  # the stuck one is waited for first
    del late
    asyncio.get_running_loop().call_later(0.05, ending.end)
    del ending
    with anyio.fail_after(5):
        await _progress.settle_graveyard(0.3)
    gc.collect()
    assert yard.kept_for_good == [stuck] and late_gone() is None
    assert len(yard) == 0 and not yard.posted_requests()


CHILD = textwrap.dedent("""
    import asyncio, gc, time, weakref
    import ucxx
    from aioembed_ucx._context import ensure_context
    from aioembed_ucx._graveyard import GRAVEYARD
    from aioembed_ucx._options import UcxOptions
    from aioembed_ucx._progress import bury_posted, cancel_posted, post, settle_graveyard

    class Owned(bytearray):
        pass

    async def main():
        ensure_context(UcxOptions(tls="tcp", progress_mode="thread"))
        runs = runs_posted_at_abort = 0
        while runs < 300 and runs_posted_at_abort < 3:  # a race with ucxx's progress thread: seen in 6-100 % of runs
            runs += 1
            run = runs
            got = asyncio.get_running_loop().create_future()
            async def handler(ep):
                got.set_result(ep)
            listener = ucxx.create_listener(handler)
            client = await ucxx.create_endpoint("127.0.0.1", listener.port)
            server = await got
            buffers = [Owned(64) for _ in range(16)]
            watch = [weakref.ref(b) for b in buffers]
            pending = [post(server, b, ("data", k), send=False) for k, b in enumerate(buffers)]
            requests = [p.request for p in pending]
            del buffers
            await asyncio.sleep(0.01)  # submitted by the progress thread
            client.abort()  # the peer goes away ...
            deadline = time.monotonic() + 5
            while server._ep.alive and time.monotonic() < deadline:
                await asyncio.sleep(0)  # ... and ucxx's error handler runs on the progress thread
            cancel_posted(pending)
            bury_posted(server, pending)  # as _receive_write does, then the connection is aborted
            del pending
            server.abort()
            posted = [k for k, r in enumerate(requests) if not r.completed]
            runs_posted_at_abort += bool(posted)
            GRAVEYARD.prune(time.monotonic() + 10 * GRAVEYARD.GRACE)  # long after: only UCX's word counts
            gc.collect()
            lost = [k for k in posted if not requests[k].completed and watch[k]() is None]
            assert not lost, f"run {run}: {len(lost)} receives still posted, their buffers let go"
            await settle_graveyard(5.0)  # what an owner's close does
            gc.collect()
            assert all(r.completed for r in requests), f"run {run}: not cancelled within 5 s of the abort"
            assert not GRAVEYARD.posted_requests() and not GRAVEYARD.kept_for_good and len(GRAVEYARD) == 0
            assert all(w() is None for w in watch), f"run {run}: buffers kept after UCX let go of them"
            del requests, server, client
            listener.close()
        print("ok", runs, runs_posted_at_abort, flush=True)

    asyncio.run(main())
""")


def test_in_thread_mode_receives_still_posted_after_an_abort_keep_their_buffers_until_cancelled() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=200, check=False)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    posted_at_abort = int(proc.stdout.split()[-1])
    assert posted_at_abort > 0, "no abort returned with a receive still posted: the case under test did not occur"
