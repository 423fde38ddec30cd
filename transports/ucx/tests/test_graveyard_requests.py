"""The graveyard lets a buffer go only once UCX is done with it: its endpoint dead, every buried request
completed or cancelled, and a grace period over; and what it keeps owns the memory (not a view of it).

In ucxx's ``thread`` progress mode, once the peer failed, ucxx's error handler only schedules the cancellation
of the endpoint's requests on the progress thread and ``abort()`` returns at once, with receives still posted
(measured with 50 aborts after the peer's: 20 returned so; the last test repeats it 30 times). Counting the
grace period from the abort left those buffers to a timer instead of to UCX's own word."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from typing import Any

import anyio
import pytest

from aioembed_ucx._graveyard import Graveyard

from .conftest import UCX_OPTIONS

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


def test_a_dead_endpoints_buffers_stay_while_a_buried_request_is_still_posted() -> None:
    yard = Graveyard()
    request = _Request()
    scratch = _Owned(64)
    watch = weakref.ref(scratch)
    yard.bury(_Endpoint(), scratch, request)
    del scratch
    for now in (1000.0, 1000.0 + 3 * Graveyard.GRACE, 1000.0 + 10 * Graveyard.GRACE):
        yard.prune(now)
        gc.collect()
        assert watch() is not None and len(yard) == 1  # UCX may still fill it, however long ago the abort was
    request.completed = True  # completed or cancelled: the grace period starts now
    t = 1000.0 + 11 * Graveyard.GRACE
    yard.prune(t)
    assert len(yard) == 1
    yard.prune(t + Graveyard.GRACE + 1)
    gc.collect()
    assert len(yard) == 0 and watch() is None


def test_a_request_whose_state_cannot_be_read_keeps_its_buffers() -> None:
    class Broken:
        @property
        def completed(self) -> bool:
            raise RuntimeError("request gone")

    yard = Graveyard()
    yard.bury(_Endpoint(), bytearray(8), Broken())
    yard.prune(1000.0)
    yard.prune(1000.0 + 10 * Graveyard.GRACE)
    assert len(yard) == 1


async def test_a_posted_message_carries_its_request_and_keeps_the_memory_owner_alive() -> None:
    """In every progress mode (``AIOEMBED_UCX_TEST_PROGRESS``), what :func:`post` returns and the graveyard keeps
    holds the request (so the graveyard can ask UCX) and the object that owns the memory: ucxx's ``Array``
    keeps the exporter of the buffer (``obj``), not a view that lets it go."""
    import asyncio

    import ucxx

    from aioembed_ucx._context import ensure_context
    from aioembed_ucx._graveyard import GRAVEYARD
    from aioembed_ucx._options import UcxOptions
    from aioembed_ucx._progress import cancel_posted, install_armed_progress, post

    ensure_context(UcxOptions.parse(UCX_OPTIONS))
    install_armed_progress(ucxx)
    got: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def handler(ep: Any) -> None:
        got.set_result(ep)

    listener = ucxx.create_listener(handler)
    client = await ucxx.create_endpoint("127.0.0.1", listener.port)
    server = await got
    try:
        scratch = _Owned(4096)
        watch = weakref.ref(scratch)
        posted = post(server, scratch, ("never", "sent"), send=False)
        assert posted.request is not None and not posted.completed
        assert posted.buffer.obj is scratch
        cancel_posted([posted])
        GRAVEYARD.bury(server, posted)
        del scratch, posted
        gc.collect()
        assert watch() is not None  # kept by the graveyard, through the Array, while the receive is posted
        server.abort()
        with anyio.fail_after(5):
            while any(not getattr(p, "completed", True) for _, kept, _ in GRAVEYARD._entries for p in kept):
                await asyncio.sleep(0.01)  # the abort cancels it (on the progress thread in ``thread`` mode)
    finally:
        client.abort()
        listener.close()


CHILD = textwrap.dedent("""
    import asyncio, time
    import ucxx
    from aioembed_ucx._context import ensure_context
    from aioembed_ucx._graveyard import GRAVEYARD
    from aioembed_ucx._options import UcxOptions
    from aioembed_ucx._progress import cancel_posted, post

    async def main():
        ensure_context(UcxOptions(tls="tcp", progress_mode="thread"))
        still_posted_at_abort = 0
        for run in range(30):
            got = asyncio.get_running_loop().create_future()
            async def handler(ep):
                got.set_result(ep)
            listener = ucxx.create_listener(handler)
            client = await ucxx.create_endpoint("127.0.0.1", listener.port)
            server = await got
            pending = [post(server, bytearray(64), ("data", k), send=False) for k in range(16)]
            await asyncio.sleep(0.01)  # submitted by the progress thread
            client.abort()  # the peer goes away ...
            deadline = time.monotonic() + 5
            while server._ep.alive and time.monotonic() < deadline:
                await asyncio.sleep(0)  # ... and ucxx's error handler runs on the progress thread
            cancel_posted(pending)
            GRAVEYARD.bury(server, *pending)  # as _receive_write does, then the connection is aborted
            server.abort()
            still = sum(not p.completed for p in pending)
            still_posted_at_abort += still > 0
            GRAVEYARD.prune(time.monotonic() + 10 * GRAVEYARD.GRACE)  # long after: only UCX's word counts
            kept = {id(p) for _, bufs, _ in GRAVEYARD._entries for p in bufs}
            lost = [p for p in pending if not p.completed and id(p) not in kept]
            assert not lost, f"run {run}: {len(lost)} receives still posted, their buffers let go"
            deadline = time.monotonic() + 10  # cancelled on the progress thread, soon (a loaded host: later)
            while not all(p.completed for p in pending):
                assert time.monotonic() < deadline, f"run {run}: not cancelled 10 s after the abort"
                await asyncio.sleep(0.01)
            listener.close()
        print("ok", still_posted_at_abort, flush=True)

    asyncio.run(main())
""")


def test_in_thread_mode_receives_still_posted_after_an_abort_keep_their_buffers() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-3000:])
