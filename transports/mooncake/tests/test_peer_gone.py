"""A write to a peer that went away fails with a clear TransportError within the timeout, never hangs.

The peer is a real endpoint in another process (``peer_proc.py``): killed with SIGKILL, or
stopped with SIGSTOP (a hung peer whose kernel still holds the connection open).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from aioembed.errors import TransportError
from aioembed.transports.base import MemoryRegion, WriteOp

from aioembed_mooncake import MooncakeTransport

sys.path.insert(0, str(Path(__file__).parent))
from procstate import wait_stopped

pytestmark = pytest.mark.anyio

TIMEOUT = 5  # the engine's minimum transfer_timeout
# One host: no partition can hold a closed socket's bytes. A leftover that ended failed adds write_lifetime, which
# over TCP defaults to what a kernel retransmits (104 s); with this it stays the lanes' 32 s (see below).
OPTIONS = {"protocol": "tcp", "hostname": "127.0.0.1", "transfer_timeout": TIMEOUT, "tcp_orphan_seconds": 1.0}
SIZE = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the failure path is loop-independent; the conformance suite covers trio


@pytest.fixture
def peer() -> Iterator[tuple[subprocess.Popen[str], dict[str, object]]]:
    with _peer_process(SIZE, OPTIONS) as started:
        yield started


@contextmanager
def _peer_process(size: int, options: dict[str, object]) -> Iterator[tuple[subprocess.Popen[str], dict[str, object]]]:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("peer_proc.py")), str(size), json.dumps(options)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        yield proc, info
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()


def _sum(proc: subprocess.Popen[str], off: int, n: int) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"sum {off} {n}\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


async def test_write_to_killed_peer_fails_fast(peer: tuple[subprocess.Popen[str], dict[str, object]]) -> None:
    proc, info = peer
    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    async with await MooncakeTransport.open(OPTIONS) as t:
        await t.register([MemoryRegion(src.data_ptr(), SIZE)])
        link = await t.connect(bytes.fromhex(str(info["descriptor"])))
        dst = int(str(info["addr"]))
        await link.write([WriteOp(src.data_ptr(), dst, SIZE)])
        assert _sum(proc, 0, SIZE) == hashlib.sha1(src.numpy().tobytes()).hexdigest()  # arrived, before kill
        proc.kill()
        proc.wait()
        for _ in range(3):  # the first write after the death and later ones (reconnect back-off)
            started = time.monotonic()
            with pytest.raises(TransportError) as err:
                await link.write([WriteOp(src.data_ptr(), dst, 4096)])
            assert time.monotonic() - started < TIMEOUT + 2
            msg = str(err.value)
            assert link.session in msg and "4096" in msg and "may still be written" in msg


async def test_write_to_hung_peer_fails_within_transfer_timeout(
    peer: tuple[subprocess.Popen[str], dict[str, object]],
) -> None:
    proc, info = peer
    src = torch.full((SIZE,), 7, dtype=torch.uint8)
    async with await MooncakeTransport.open(OPTIONS) as t:
        await t.register([MemoryRegion(src.data_ptr(), SIZE)])
        link = await t.connect(bytes.fromhex(str(info["descriptor"])))
        dst = int(str(info["addr"]))
        await link.write([WriteOp(src.data_ptr(), dst + 8192, 16)])
        os.kill(proc.pid, signal.SIGSTOP)
        wait_stopped(proc.pid)  # SIGSTOP is asynchronous: the peer could still take the write in
        started = time.monotonic()
        with pytest.raises(TransportError) as err:
            await link.write([WriteOp(src.data_ptr(), dst, SIZE)])
        elapsed = time.monotonic() - started
        assert TIMEOUT - 0.5 <= elapsed < TIMEOUT + 3, elapsed
        msg = str(err.value)
        # Two clocks of the same length race: the write's deadline (transfer_timeout) and the engine's TCP lanes,
        # which the plugin sets to drop a peer that makes no progress for transfer_timeout. Either way the error
        # says why and that the destination may not be reused yet.
        assert (f"transfer_timeout={TIMEOUT}s" in msg and "may still land" in msg) or (
            f"no progress within the engine's TCP lane timeout, {TIMEOUT}s" in msg and "may still be written" in msg
        ), msg
        assert str(SIZE) in msg and link.session in msg
        os.kill(proc.pid, signal.SIGCONT)


async def test_a_timed_out_write_settles_once_its_transfers_end_and_leaves_the_link_usable() -> None:
    """A write that timed out leaves its transfers in the engine holding the link's credits. They held every
    credit, and only a waiting write polled them, so every later write waited for credits for ever, even
    once the peer was back (found by a review). Now a write waiting for credits polls them, and the error
    says when they ended (``settled``: the sender fences until then)."""
    size = 64 << 20
    options: dict[str, object] = dict(OPTIONS, max_batch_bytes=64 << 10, max_batch_ops=1024, threads=1)
    with _peer_process(size, options) as (proc, info):
        src = torch.full((size,), 3, dtype=torch.uint8)
        async with await MooncakeTransport.open(options) as t:
            link, dst = await _linked(t, src, info)
            os.kill(proc.pid, signal.SIGSTOP)
            wait_stopped(proc.pid)
            with pytest.raises(TransportError) as err:
                await link.write([WriteOp(src.data_ptr(), dst, size)])  # 1024 transfers: every credit
            assert err.value.may_land is True and err.value.settled is not None
            assert link._credits.available < link._credits.total  # the leftovers hold credits
            settled = err.value.settled
            with anyio.move_on_after(1.0) as early:
                await settled()
            assert early.cancelled_caught, "settled while the peer is still frozen"
            os.kill(proc.pid, signal.SIGCONT)
            started = time.monotonic()
            await link.write([WriteOp(src.data_ptr(), dst, 16)])  # waits for credits, polling the leftovers
            # A leftover the lanes' timeout ended failed (-1) adds write_lifetime (32 s, about half the runs): the
            # sender's fence is write_lifetime from the write's failure anyway, so this costs it ~3 s, not 32.
            with anyio.fail_after(60):
                await settled()
            print(f"small write and settling after the thaw: {time.monotonic() - started:.2f} s")
            assert t._poller.pending == 0 and link._credits.available == link._credits.total
            assert _sum(proc, 0, 16) == hashlib.sha1(bytes([3] * 16)).hexdigest()


@pytest.mark.parametrize(("status", "waits"), [(1, False), (-1, True)])
async def test_a_leftover_that_did_not_complete_settles_write_lifetime_later(status: int, waits: bool) -> None:
    """A leftover reported failed (-1) had its lane's connection closed gracefully: the sender's kernel still
    delivers what it had queued (MiBs) whenever the peer reads again (after a thaw, or a partition's heal), so
    ``orphan_lifetime`` after ``settled`` (2 s of the sender's time) does not bound it; ``write_lifetime`` more
    does as well as before. (-2, the engine's slice timeout, is not an end: ``test_transfers.py``.)"""
    from types import SimpleNamespace

    from aioembed_mooncake._transfers import PendingTransfer, TransferPoller

    poller = TransferPoller(lambda batch: status)
    left = PendingTransfer(1, SIZE)
    poller.add([left])
    endpoint = SimpleNamespace(_poller=poller, write_lifetime=1.0)
    started = anyio.current_time()
    with anyio.fail_after(5):
        await MooncakeTransport._settled(endpoint, [left])  # type: ignore[arg-type]
    assert left.status == status and poller.pending == 0
    assert (anyio.current_time() - started >= endpoint.write_lifetime) is waits


async def test_a_write_waiting_for_credits_fails_cleanly_when_its_link_closes(
    peer: tuple[subprocess.Popen[str], dict[str, object]],
) -> None:
    """It failed as an ExceptionGroup the boundary mapped to may_land=True: its blocks fenced for 32 s for
    nothing (found by a review)."""
    _proc, info = peer
    src = torch.full((SIZE,), 5, dtype=torch.uint8)
    async with await MooncakeTransport.open(OPTIONS) as t:
        link, dst = await _linked(t, src, info)
        held = await link._credits.take(link._credits.total)  # every credit in use: the next write waits
        failures: list[TransportError] = []

        async def write() -> None:
            try:
                await link.write([WriteOp(src.data_ptr(), dst, 16)])
            except TransportError as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            with anyio.fail_after(5):
                while not link._credits._waiters:  # (it polls now and then: never "all tasks blocked")
                    await anyio.sleep(0.01)
            await link.aclose()
        assert len(failures) == 1 and failures[0].may_land is False and "closed link" in str(failures[0])
        assert held == link._credits.total


async def _linked(t: MooncakeTransport, src: torch.Tensor, info: dict[str, object]) -> tuple[Any, int]:
    """A link to the peer process, warmed up by a first small write; and the peer's pool address."""
    await t.register([MemoryRegion(src.data_ptr(), src.numel())])
    link = await t.connect(bytes.fromhex(str(info["descriptor"])))
    dst = int(str(info["addr"]))
    await link.write([WriteOp(src.data_ptr(), dst, 16)])
    return link, dst


@pytest.mark.parametrize(("protocol", "elapsed", "explained"),
                         [("tcp", 5.01, True), ("tcp", 2.0, False), ("rdma", 5.01, False)])
def test_a_write_the_lanes_dropped_says_so(protocol: str, elapsed: float, explained: bool) -> None:
    """The lanes give up on a peer at their timeout, which the plugin sets from transfer_timeout: that failure
    comes at the moment the write's own deadline would, and said only "ended with status [-1]" (the
    explanation was keyed to the 30 s floor of ``progress_timeout``, so it never showed at a shorter one)."""
    from types import SimpleNamespace

    from aioembed_mooncake._transfers import PendingTransfer

    failed = PendingTransfer(1, SIZE)
    failed.status = -1
    endpoint = SimpleNamespace(config=SimpleNamespace(protocol=protocol), _lane_timeout=TIMEOUT)
    link = SimpleNamespace(session="127.0.0.1:15000")
    with pytest.raises(TransportError) as err:
        MooncakeTransport._raise_failed(endpoint, link, [failed], refused=0, total=SIZE,  # type: ignore[arg-type]
                                        pieces=1, ops=1, elapsed=elapsed)
    msg = str(err.value)
    assert "127.0.0.1:15000" in msg and "status [-1]" in msg and "may still be written" in msg
    assert (f"no progress within the engine's TCP lane timeout, {TIMEOUT}s" in msg) is explained, msg


async def test_a_close_after_a_connect_cancelled_on_a_frozen_peer_destroys_the_engine_when_its_call_returns(
    peer: tuple[subprocess.Popen[str], dict[str, object]],
) -> None:
    """connect()'s probe and one-byte read run in worker threads that a cancelled connect() abandons; against a
    frozen peer they return only at the engine's timeout. ``aclose()`` then left the engine to them: it was
    destroyed on a worker thread whenever the call returned, and the environment the plugin set for it
    (``MC_FORCE_TCP``) was never the user's again, though no engine ran any more (found by a review). Now the
    last such call to return destroys it as ``aclose()`` does."""
    import weakref

    from aioembed_mooncake import _engine

    proc, info = peer
    assert _engine._engines_alive() == 0, "an engine of an earlier test is still alive"
    before = _engine._USERS.get("MC_FORCE_TCP", os.environ.get("MC_FORCE_TCP"))  # the user's own value
    os.kill(proc.pid, signal.SIGSTOP)
    wait_stopped(proc.pid)
    t = await MooncakeTransport.open(OPTIONS)
    engine = weakref.ref(t._engine)
    port = t.rpc_port
    with anyio.move_on_after(1.0) as scope:
        await t.connect(bytes.fromhex(str(info["descriptor"])))
    assert scope.cancelled_caught, "connect() to a frozen peer returned"
    await t.aclose()  # returns at once: the abandoned call holds the engine until the peer answers
    assert engine() is not None  # still in the abandoned call's hands
    os.kill(proc.pid, signal.SIGCONT)  # the peer answers: the abandoned call returns
    with anyio.fail_after(60):
        while engine() is not None:
            await anyio.sleep(0.02)
    with anyio.move_on_after(5):  # the weak reference dies as the destructor begins: the rest comes after it
        while os.environ.get("MC_FORCE_TCP") != before:
            await anyio.sleep(0.02)
    assert _engine._engines_alive() == 0
    assert os.environ.get("MC_FORCE_TCP") == before, "the engine is gone, but the environment set for it stayed"
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
        pass  # its handshake listener is gone with it


class _SubmitFailsAfter:
    """An engine whose ``transfer_submit_write`` raises after ``n`` calls (anything else goes to the real one)."""

    def __init__(self, engine: Any, n: int) -> None:
        self._engine, self._left = engine, n

    def transfer_submit_write(self, *args: Any) -> int:
        if self._left == 0:
            raise RuntimeError("engine refused the submit")
        self._left -= 1
        return int(self._engine.transfer_submit_write(*args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


async def test_a_submit_that_raises_partway_says_when_the_transfers_it_left_ended(
    peer: tuple[subprocess.Popen[str], dict[str, object]],
) -> None:
    """The engine raised at the third submit of a batch: the write failed with that RuntimeError (the session's
    boundary makes it a TransportError with no ``settled``), and the two transfers already submitted, which go on
    moving for as long as they make progress, were fenced only for ``write_lifetime``, unlike those of a write
    that timed out (found by a review). Now it is a TransportError whose ``settled`` waits for them."""
    proc, info = peer
    src = torch.full((SIZE,), 9, dtype=torch.uint8)
    async with await MooncakeTransport.open(dict(OPTIONS, max_batch_bytes=64 << 10)) as t:
        link, dst = await _linked(t, src, info)
        os.kill(proc.pid, signal.SIGSTOP)
        wait_stopped(proc.pid)
        real = t._engine
        t._engine = _SubmitFailsAfter(real, 2)
        try:
            with pytest.raises(TransportError) as err:
                await link.write([WriteOp(src.data_ptr(), dst, SIZE)])  # 16 transfers of 64 KiB
        finally:
            t._engine = real
        assert err.value.may_land is True and err.value.settled is not None, err.value
        assert isinstance(err.value.__cause__, RuntimeError) and link.session in str(err.value)
        settled = err.value.settled
        with anyio.move_on_after(1.0) as early:
            await settled()
        assert early.cancelled_caught, "settled while the peer is still frozen"
        os.kill(proc.pid, signal.SIGCONT)
        with anyio.fail_after(60):
            await settled()
        assert t._poller.pending == 0 and link._credits.available == link._credits.total


async def test_a_failed_writes_error_kept_past_close_does_not_keep_the_engine(
    peer: tuple[subprocess.Popen[str], dict[str, object]],
) -> None:
    """A failed write's TransportError kept its traceback, whose frame of the write held the engine in a local:
    a sender that kept the error (a room's failure) and closed had ``aclose()`` leave the engine alive (threads,
    listener), destroyed later wherever the error went, and the environment set for it never given back
    (found by a review)."""
    import gc
    import weakref

    from aioembed_mooncake import _engine

    proc, info = peer
    gc.collect()
    assert _engine._engines_alive() == 0, "an engine of an earlier test is still alive"
    before = _engine._USERS.get("MC_FORCE_TCP", os.environ.get("MC_FORCE_TCP"))  # the user's own value
    src = torch.full((SIZE,), 4, dtype=torch.uint8)
    t = await MooncakeTransport.open(OPTIONS)
    engine = weakref.ref(t._engine)
    link, dst = await _linked(t, src, info)
    proc.kill()
    proc.wait()
    with pytest.raises(TransportError) as err:
        await link.write([WriteOp(src.data_ptr(), dst, 4096)])
    await t.aclose()
    assert err.value.__traceback__ is not None  # kept, as a room's failure keeps it
    assert engine() is None, "aclose() left the engine alive: the failed write's error holds it"
    assert os.environ.get("MC_FORCE_TCP") == before, "the environment set for the engine stayed"
