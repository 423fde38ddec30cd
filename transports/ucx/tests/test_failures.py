"""Peer gone (SIGKILL), peer frozen (SIGSTOP), refusals by the owning side."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from aioembed.errors import TransportError
from aioembed.testing import region_of
from aioembed.transports.base import MemoryRegion, Transport, WriteOp
from aioembed.transports.registry import open_transport

from .conftest import UCX_OPTIONS

pytestmark = pytest.mark.anyio

OWNER = Path(__file__).with_name("_owner.py")
SIZE = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextmanager
def owner_process(**options: Any) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    # stderr to a file, not a pipe: a chatty owner never blocks on it
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen([sys.executable, str(OWNER), json.dumps(dict(UCX_OPTIONS, **options)), str(SIZE)],
                                stdout=subprocess.PIPE, stderr=errors)
        try:
            assert proc.stdout is not None
            skipped = []  # UCX logs to stdout too (e.g. a failed bind): not the owner's line
            line = proc.stdout.readline()
            while line and not line.startswith(b"{"):
                skipped.append(line.decode(errors="replace"))
                line = proc.stdout.readline()
            if not line:
                proc.wait()
                errors.seek(0)
                raise AssertionError(f"the owner process did not start: {''.join(skipped)[-2000:]}"
                                     f"{errors.read().decode()[-2000:]}")
            info = json.loads(line)
            yield proc, info
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait()


@asynccontextmanager
async def writer(**options: Any) -> AsyncIterator[tuple[Transport, torch.Tensor]]:
    t = await open_transport("ucx", dict(UCX_OPTIONS, **options))
    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8)
    await t.register([region_of(src)])
    try:
        yield t, src
    finally:
        await t.aclose()


async def test_owner_killed_fails_the_next_write_quickly() -> None:
    with owner_process() as (proc, info):
        async with writer(write_timeout=30.0) as (t, src):
            link = await t.connect(bytes.fromhex(info["descriptor"]))
            await link.write([WriteOp(src.data_ptr(), info["address"], SIZE)])
            proc.kill()
            proc.wait()
            start = time.monotonic()
            with pytest.raises(TransportError):
                for _ in range(3):  # the first write may race the reset; none may succeed for long
                    await link.write([WriteOp(src.data_ptr(), info["address"], SIZE)])
            elapsed = time.monotonic() - start
            print(f"write to a killed owner failed after {elapsed * 1000:.0f} ms")
            assert elapsed < 5.0  # far below write_timeout: the endpoint error is seen


async def test_owner_killed_during_a_write() -> None:
    with owner_process() as (proc, info):
        async with writer(write_timeout=30.0) as (t, src):
            link = await t.connect(bytes.fromhex(info["descriptor"]))
            os.kill(proc.pid, signal.SIGSTOP)  # the write hangs in flight ...
            task = asyncio.ensure_future(link.write([WriteOp(src.data_ptr(), info["address"], SIZE)]))
            await asyncio.sleep(0.3)
            proc.kill()  # ... until the peer dies
            start = time.monotonic()
            with pytest.raises(TransportError):
                await task
            elapsed = time.monotonic() - start
            print(f"write in flight failed {elapsed * 1000:.0f} ms after its owner was killed")
            assert elapsed < 5.0


async def test_frozen_owner_fails_within_write_timeout() -> None:
    with owner_process() as (proc, info):
        async with writer(write_timeout=1.0) as (t, src):
            link = await t.connect(bytes.fromhex(info["descriptor"]))
            await link.write([WriteOp(src.data_ptr(), info["address"], 4096)])
            os.kill(proc.pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(TransportError, match="write_timeout"):
                await link.write([WriteOp(src.data_ptr(), info["address"], SIZE)])
            assert 0.9 < time.monotonic() - start < 3.0
            # the next write reconnects, and still fails in bounded time while the peer is frozen
            start = time.monotonic()
            with pytest.raises(TransportError):
                await link.write([WriteOp(src.data_ptr(), info["address"], 4096)])
            assert time.monotonic() - start < 3.0
            os.kill(proc.pid, signal.SIGCONT)
            # thawed: writes work again on a fresh endpoint
            await link.write([WriteOp(src.data_ptr(), info["address"], 4096)])


@pytest.mark.parametrize("eager_bytes", [0, SIZE])
async def test_owner_refuses_memory_it_no_longer_registers(eager_bytes: int) -> None:
    """The owning side checks its *current* registrations before receiving a byte into its memory: with the
    go-ahead before any data is sent, and for an eager write (data already on its way) by taking the data
    into scratch memory."""
    async with await open_transport("ucx", UCX_OPTIONS) as owner, writer(eager_bytes=eager_bytes) as (t, src):
        dst = torch.zeros(SIZE, dtype=torch.uint8)
        await owner.register([region_of(dst)])
        link = await t.connect(owner.descriptor())
        endpoint = link.inner._ep  # type: ignore[attr-defined]
        await owner.unregister([region_of(dst)])
        with pytest.raises(TransportError, match=r"refused the write.*outside the memory registered"):
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), SIZE)])
        assert int(dst.sum()) == 0
        await owner.register([region_of(dst)])  # the link is still usable after a refusal, without a reconnect
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), SIZE)])
        assert torch.equal(dst, src)
        assert link.inner._ep is endpoint  # type: ignore[attr-defined]
        assert owner.inner.eager_writes_received == (1 if eager_bytes else 0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("eager_bytes", [0, SIZE])
async def test_forged_descriptor_cannot_reach_outside_registered_memory(eager_bytes: int) -> None:
    """A writer that lies about the owner's regions is refused by the owner, not trusted."""
    async with await open_transport("ucx", UCX_OPTIONS) as owner, writer(eager_bytes=eager_bytes) as (t, src):
        dst = torch.zeros(2 * SIZE, dtype=torch.uint8)
        await owner.register([region_of(dst[:SIZE])])
        desc = msgpack.unpackb(owner.descriptor())
        desc["regions"] = [[dst.data_ptr(), 2 * SIZE, "cpu"]]  # claims twice the registered span
        link = await t.connect(msgpack.packb(desc))
        with pytest.raises(TransportError, match="refused"):
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr() + SIZE, 4096)])
        with pytest.raises(TransportError, match="refused"):  # one bad op refuses the whole write
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096),
                              WriteOp(src.data_ptr(), dst.data_ptr() + SIZE - 10, 20)])
        assert int(dst.sum()) == 0


async def test_descriptor_of_another_endpoint_is_refused() -> None:
    async with await open_transport("ucx", UCX_OPTIONS) as owner, writer() as (t, _):
        desc = msgpack.unpackb(owner.descriptor())
        desc["endpoint"] = "f" * 32  # a restarted peer that reuses the port
        with pytest.raises(TransportError, match="refused the connection"):
            await t.connect(msgpack.packb(desc))


async def test_nobody_listening() -> None:
    async with writer(connect_timeout=3.0) as (t, _):
        desc = {"transport": "ucx", "v": 1, "endpoint": "0" * 32, "host": "127.0.0.1", "port": 9,
                "regions": [[4096, 4096, "cpu"]]}
        start = time.monotonic()
        with pytest.raises(TransportError, match="cannot connect"):
            await t.connect(msgpack.packb(desc))
        assert time.monotonic() - start < 4.0


async def test_unregistered_region_objects() -> None:
    async with writer() as (t, _):
        with pytest.raises(TransportError):
            await t.unregister([MemoryRegion(4096, 4096)])


def test_the_graveyard_of_failed_connects_is_bounded_by_what_ucx_may_still_write() -> None:
    from aioembed_ucx._graveyard import Graveyard as _Graveyard

    class Endpoint:
        def __init__(self) -> None:
            self.alive = True

    yard = _Graveyard()
    endpoints = [Endpoint() for _ in range(50)]
    for ep in endpoints:
        yard.bury(ep, bytearray(16))
    assert len(yard) == 50
    for ep in endpoints[:40]:
        ep.alive = False  # UCX is done with these: their buffers may go after the grace period
    yard.prune(now=1000.0)
    assert len(yard) == 50  # dead ones wait out the grace period
    yard.prune(now=1000.0 + _Graveyard.GRACE + 1)
    assert len(yard) == 10  # only the live ones are kept
