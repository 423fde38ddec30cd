"""Opening, closing and reopening endpoints and links: closes that race writes or cancellations, a port
reused by a restarted owner, connects that wait on a frozen owner, and what stays behind."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

import anyio
import pytest
import torch
from aioembed.errors import TransportError
from aioembed.testing import region_of
from aioembed.testing.ports import fixed_port
from aioembed.transports.base import Transport, WriteOp
from aioembed.transports.registry import open_transport

from aioembed_ucx import _progress

from .conftest import UCX_OPTIONS, ucx_link, ucx_transport
from .test_failures import owner_process, writer

pytestmark = pytest.mark.anyio

SIZE = 1 << 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _pair(**options: Any) -> tuple[Transport, Transport, torch.Tensor, torch.Tensor]:
    a = await open_transport("ucx", dict(UCX_OPTIONS, **options))
    b = await open_transport("ucx", dict(UCX_OPTIONS, **options))
    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8)
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    await a.register([region_of(src)])
    await b.register([region_of(dst)])
    return a, b, src, dst


async def test_a_link_closed_while_a_write_reconnects_opens_no_endpoint() -> None:
    a, b, src, dst = await _pair()
    try:
        link = await a.connect(b.descriptor())
        ul = ucx_link(link)
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)])
        ul._drop(ul._ep)  # as after a failed write: the next write reconnects
        task = asyncio.ensure_future(link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)]))
        await asyncio.sleep(0.001)  # inside the reconnect now
        assert not task.done()
        await link.aclose()
        with pytest.raises(TransportError, match="closed") as err:
            await task
        assert err.value.may_land is False
        assert ul._ep is None
        await anyio.sleep(0.2)
        assert not ucx_transport(b)._serving, "the owner still serves the connection the closed link opened"
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_cancelled_aclose_still_closes_everything() -> None:
    a, b, src, dst = await _pair()
    for _ in range(2):
        link = await a.connect(b.descriptor())
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)])
    await anyio.sleep(0.05)
    owner, writer_ = ucx_transport(b), ucx_transport(a)
    assert owner.port is not None and len(owner._serving) == 2
    for t in (b, a):
        with anyio.CancelScope() as scope:
            scope.cancel()  # say, a task group being cancelled runs this close in a finally
            await t.aclose()
    assert owner.port is None, "the listener stayed open"
    assert not owner._serving and not owner._server_eps
    assert not writer_._links


async def test_a_restarted_owner_listens_again_on_its_fixed_port_at_once() -> None:
    port = fixed_port()  # below the ephemeral range: no outgoing connection takes it between the two owners
    async with writer() as (w, src):
        for attempt in range(2):
            # The second owner starts while the first one's sockets on the port are in TIME_WAIT (without
            # SO_REUSEADDR it could not listen for about a minute: "Device is busy").
            with owner_process(port=port) as (proc, info):
                link = await w.connect(bytes.fromhex(info["descriptor"]))
                await link.write([WriteOp(src.data_ptr(), info["address"], 4096)])
                proc.kill()  # it dies with the connection open: its end of it goes to TIME_WAIT
                proc.wait()
                print(f"owner {attempt} on port {port}: written")
            await link.aclose()


async def test_a_connect_waiting_on_a_frozen_owner_does_not_spin() -> None:
    with owner_process() as (proc, info):
        async with writer(connect_timeout=1.5) as (w, _):
            os.kill(proc.pid, signal.SIGSTOP)
            cpu, start = time.process_time(), time.monotonic()
            with pytest.raises(TransportError, match="connect_timeout") as err:
                await w.connect(bytes.fromhex(info["descriptor"]))
            elapsed = time.monotonic() - start
            share = (time.process_time() - cpu) / elapsed
            print(f"connect to a frozen owner: failed after {elapsed:.2f} s, {share:.2f} CPU-s/s")
            assert err.value.may_land is False
            assert elapsed < 4.0
            if UCX_OPTIONS["progress_mode"] == "blocking":  # the other modes poll by design
                assert share < 0.3  # it was 1.0: ucxx's own request wait polls on every loop turn


async def test_an_unexpected_error_serving_a_write_ends_the_connection(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    a, b, src, dst = await _pair(write_timeout=20.0)
    try:
        link = await a.connect(b.descriptor())
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)])

        async def broken(*args: Any) -> None:
            raise MemoryError("no memory for that write")

        monkeypatch.setattr(ucx_transport(b), "_receive_write", broken)
        start = time.monotonic()
        with caplog.at_level(logging.ERROR, "aioembed.transports.ucx"), pytest.raises(TransportError):
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)])
        assert time.monotonic() - start < 5.0  # not the writer's write_timeout (20 s)
        assert any("failed unexpectedly" in r.message and r.exc_info for r in caplog.records)
        monkeypatch.undo()
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), SIZE)])  # a new connection works
        assert torch.equal(dst, src)
    finally:
        await a.aclose()
        await b.aclose()


def test_drivers_of_closed_event_loops_are_forgotten() -> None:
    closed = asyncio.new_event_loop()
    closed.close()
    running = asyncio.new_event_loop()
    try:
        table: dict[Any, Any] = {closed: object(), running: object()}
        _progress._forget_closed_loops(table)
        assert list(table) == [running]
    finally:
        running.close()
