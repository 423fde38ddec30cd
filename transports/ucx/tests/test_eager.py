"""Writes without the owner's go-ahead (kind ``EAGER``): when they are used, and what the owner does
with one it refuses or did not agree to."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import gc
from typing import Any

import anyio
import msgpack
import pytest
import torch
from aioembed.errors import TransportError
from aioembed.testing import region_of
from aioembed.transports.base import Link, Transport, WriteOp
from aioembed.transports.registry import open_transport

from aioembed_ucx import _wire as w
from aioembed_ucx._graveyard import GRAVEYARD
from aioembed_ucx._options import MAX_EAGER_BYTES
from aioembed_ucx.transport import UcxLink, UcxTransport, _parse_descriptor, _Refused

from .conftest import UCX_OPTIONS, ucx_link, ucx_transport

pytestmark = pytest.mark.anyio

SIZE = 4 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _plugin(t: Transport) -> UcxTransport:
    plugin: UcxTransport = ucx_transport(t)
    return plugin


def _ucx_link(link: Link) -> UcxLink:
    inner: UcxLink = ucx_link(link)
    return inner


def _kept_addresses() -> list[int]:
    """Where the buffers of posted messages kept in the graveyard start (with their requests: ucxx Arrays)."""
    return [int(b.ptr) for _, held, _ in GRAVEYARD._entries for b, r in held if r is not None and hasattr(b, "ptr")]


def _record_burials(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, Any]]:
    """Where each buffer buried with its request starts, its size, and that request (clear the list before the
    owner closes: a request kept past it keeps the owner's listener)."""
    buried: list[tuple[int, int, Any]] = []
    bury = GRAVEYARD.bury_posted

    def recording(endpoint: Any, posted: Any) -> None:
        posted = list(posted)
        buried.extend((int(b.ptr), int(b.nbytes), r) for b, r in posted)
        bury(endpoint, posted)

    monkeypatch.setattr(GRAVEYARD, "bury_posted", recording)
    return buried


def _kept_until_done(buried: list[tuple[int, int, Any]]) -> bool:
    """Whether every buried buffer is still kept, or its request completed (UCX let go of it)."""
    kept = _kept_addresses()
    return all(r.completed or ptr in kept for ptr, _, r in buried)


async def _pair(owner_options: dict[str, Any], writer_options: dict[str, Any]) -> tuple[
        Transport, Transport, torch.Tensor, torch.Tensor]:
    owner = await open_transport("ucx", dict(UCX_OPTIONS, **owner_options))
    writer = await open_transport("ucx", dict(UCX_OPTIONS, **writer_options))
    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8)
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    await writer.register([region_of(src)])
    await owner.register([region_of(dst)])
    return owner, writer, src, dst


async def test_small_cpu_writes_go_without_the_go_ahead_and_large_ones_wait_for_it() -> None:
    owner, writer, src, dst = await _pair({}, {})
    try:
        link = await writer.connect(owner.descriptor())
        small = [WriteOp(src.data_ptr(), dst.data_ptr(), 4096),
                 WriteOp(src.data_ptr() + 8192, dst.data_ptr() + 8192, 100_000)]  # two ops, one write
        await link.write(small)
        assert (_plugin(owner).writes_received, _plugin(owner).eager_writes_received) == (1, 1)
        assert torch.equal(dst[:4096], src[:4096]) and torch.equal(dst[8192:108_192], src[8192:108_192])
        assert int(dst[4096:8192].sum()) == 0
        big = (1 << 20) + 1  # over the default eager_bytes
        await link.write([WriteOp(src.data_ptr() + (1 << 20), dst.data_ptr() + (1 << 20), big)])
        assert (_plugin(owner).writes_received, _plugin(owner).eager_writes_received) == (2, 1)
        assert torch.equal(dst[1 << 20:(1 << 20) + big], src[1 << 20:(1 << 20) + big])
    finally:
        await writer.aclose()
        await owner.aclose()


@pytest.mark.parametrize(("owner_eager", "writer_eager"), [(0, 1 << 20), (1 << 20, 0), (8192, 1 << 20)])
async def test_the_smaller_of_both_settings_decides(owner_eager: int, writer_eager: int) -> None:
    owner, writer, src, dst = await _pair({"eager_bytes": owner_eager}, {"eager_bytes": writer_eager})
    try:
        link = await writer.connect(owner.descriptor())
        limit = min(owner_eager, writer_eager)
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 8192)])
        await link.write([WriteOp(src.data_ptr() + 8192, dst.data_ptr() + 8192, 8193)])
        assert _plugin(owner).writes_received == 2
        assert _plugin(owner).eager_writes_received == (limit >= 8192) + (limit >= 8193)
        assert torch.equal(dst[:16385], src[:16385])
    finally:
        await writer.aclose()
        await owner.aclose()


async def test_an_eager_write_over_the_announced_size_ends_the_connection_and_writes_nothing() -> None:
    """A writer that ignores the owner's descriptor cannot make it buffer more than it agreed to."""
    owner, writer, src, dst = await _pair({"eager_bytes": 4096}, {})
    try:
        link = await writer.connect(owner.descriptor())
        ucx = _ucx_link(link)
        announced = ucx._peer
        assert announced.eager_bytes == 4096
        ucx._peer = dataclasses.replace(announced, eager_bytes=1 << 20)  # lies about the owner's limit
        first = ucx._ep
        with pytest.raises(TransportError) as info, anyio.fail_after(1):  # the owner's abort is seen at once
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 65536)])
        assert not isinstance(info.value.__cause__ or info.value, _Refused)  # dropped, not refused and drained
        assert int(dst.sum()) == 0 and _plugin(owner).writes_received == 0
        assert ucx._ep is None  # the writer dropped its endpoint ...
        with anyio.fail_after(5):  # ... and the owner's side of the connection ends too
            while _plugin(owner)._server_eps:
                await asyncio.sleep(0.01)
        ucx._peer = announced
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 65536)])  # a new connection, as agreed
        assert ucx._ep is not None and ucx._ep is not first
        assert torch.equal(dst[:65536], src[:65536])
        assert (_plugin(owner).writes_received, _plugin(owner).eager_writes_received) == (1, 0)
    finally:
        await writer.aclose()
        await owner.aclose()


async def test_the_descriptor_carries_the_eager_size() -> None:
    async with await open_transport("ucx", dict(UCX_OPTIONS, eager_bytes=12345)) as t:
        desc = msgpack.unpackb(t.descriptor())
        assert desc["eager"] == 12345 and _parse_descriptor(t.descriptor()).eager_bytes == 12345
        del desc["eager"]  # a plugin without eager writes: every write waits for the go-ahead
        assert _parse_descriptor(msgpack.packb(desc)).eager_bytes == 0
        for bad in (-1, True, "1", None):
            desc["eager"] = bad
            with pytest.raises(TransportError, match="eager"):
                _parse_descriptor(msgpack.packb(desc))
        desc["eager"] = 1 << 40  # a later plugin that takes more: this one sends at most its own cap
        assert _parse_descriptor(msgpack.packb(desc)).eager_bytes == MAX_EAGER_BYTES


async def test_a_refused_eager_write_is_drained_and_the_same_connection_goes_on() -> None:
    """The owner takes a refused eager write's data (every op, and the inline blob) into scratch memory: the
    next writes on the same UCX endpoint (no reconnect) match their own messages, not the refused ones."""
    owner, writer, src, dst = await _pair({}, {"inline_bytes": 256})
    try:
        link = await writer.connect(owner.descriptor())
        ucx = _ucx_link(link)
        first = ucx._ep
        region = region_of(dst)
        await owner.unregister([region])
        ops = [WriteOp(src.data_ptr(), dst.data_ptr(), 300_000),  # a rendezvous-sized message
               WriteOp(src.data_ptr() + 400_000, dst.data_ptr() + 400_000, 100),  # inline
               WriteOp(src.data_ptr() + 500_000, dst.data_ptr() + 500_000, 2000)]  # a small direct one
        with pytest.raises(TransportError, match="refused the write") as info:
            await link.write(ops)
        assert info.value.may_land is False  # drained before the answer: the session need not fence
        assert int(dst.sum()) == 0 and _plugin(owner).writes_received == 0
        await owner.register([region])
        for k in range(3):  # the same ops again, now taken, on the same endpoint
            await link.write([WriteOp(o.src + k, o.dst + k, o.length) for o in ops])
        assert ucx._ep is first
        assert (_plugin(owner).writes_received, _plugin(owner).eager_writes_received) == (3, 3)
        for o in ops:
            a, n = o.dst - dst.data_ptr() + 2, o.length
            assert torch.equal(dst[a:a + n], src[a:a + n])
    finally:
        await writer.aclose()
        await owner.aclose()


async def test_a_writer_that_aborts_mid_write_leaves_the_owner_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer aborts its endpoint mid-write (as at a stall; a cancelled write runs to its end instead); the
    owner's write task fails with the connection and is accounted for (no "exception was never retrieved"),
    and the owner serves the next connection."""
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    owner, writer, src, dst = await _pair({}, {})
    buried = _record_burials(monkeypatch)
    try:
        link = await writer.connect(owner.descriptor())
        ucx = _ucx_link(link)
        for delay in range(6):
            dst.zero_()
            t = asyncio.ensure_future(link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 500_000)]))
            for _ in range(delay):
                await asyncio.sleep(0)
            ucx._drop(ucx._ep)
            with contextlib.suppress(TransportError):
                await t
            assert _kept_until_done(buried)
            await asyncio.sleep(0.3)
            gc.collect()
            assert _kept_until_done(buried)
        assert src.data_ptr() in {ptr for ptr, _, _ in buried}  # what a failed write had posted went to the graveyard
        buried.clear()
        dst.zero_()
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 500_000)])
        assert torch.equal(dst[:500_000], src[:500_000])
    finally:
        await writer.aclose()
        await owner.aclose()
        gc.collect()
        await asyncio.sleep(0)
        loop.set_exception_handler(previous)
    assert not [c.get("message") for c in unhandled]


async def test_what_a_failed_write_left_in_the_graveyard_goes_without_another_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers kept for a failed write are let go once its endpoint is dead and the grace period is over, even
    when nothing is buried after it: the graveyard pruned only when it buried something else (or a listener
    closed), so what a process's last failure had posted (bodies, inline blobs, an owner's eager scratch) stayed
    referenced for good."""
    monkeypatch.setattr(GRAVEYARD, "GRACE", 0.2)
    owner, writer, src, dst = await _pair({}, {})
    buried = _record_burials(monkeypatch)
    try:
        link = await writer.connect(owner.descriptor())
        ucx = _ucx_link(link)
        t = asyncio.ensure_future(link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 500_000)]))
        await asyncio.sleep(0)  # posted ...
        ucx._drop(ucx._ep)  # ... and its endpoint aborted, as after a stall
        with contextlib.suppress(TransportError):
            await t
        assert src.data_ptr() in {ptr for ptr, _, _ in buried} and _kept_until_done(buried)
        buried.clear()
        with anyio.fail_after(5):  # two grace periods at most: one to see the endpoint dead, one to wait out
            while src.data_ptr() in _kept_addresses():
                await asyncio.sleep(0.05)
    finally:
        await writer.aclose()
        await owner.aclose()


@pytest.mark.parametrize("eager_bytes", [0, 1 << 20])
async def test_a_receive_that_fails_on_the_owner_ends_the_connection(eager_bytes: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A receive failing in the owner (here: a buffer too small, as a truncated message would) leaves the
    wire state unknown: the owner aborts the connection, and the writer fails at once instead of waiting
    for an acknowledgement until its write_timeout; the buffers it had posted are kept until UCX let go of them."""
    owner, writer, src, dst = await _pair({}, {"eager_bytes": eager_bytes})
    buried = _record_burials(monkeypatch)
    try:
        link = await writer.connect(owner.descriptor())
        plugin = _plugin(owner)
        check = plugin._check_destinations

        def short_buffers(direct: list[tuple[int, int]], inline: list[tuple[int, int]]) -> list[object]:
            return [(ctypes.c_char * (n // 2)).from_address(d) for d, n in direct] if check(direct, inline) else []

        monkeypatch.setattr(plugin, "_check_destinations", short_buffers)
        with pytest.raises(TransportError), anyio.fail_after(2):  # write_timeout is 5 s
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 65536)])
        # the owner kept what it had posted, for UCX to let go of
        assert dst.data_ptr() in {ptr for ptr, _, _ in buried} and _kept_until_done(buried)
        buried.clear()
        monkeypatch.undo()
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 65536)])  # a new connection
        assert torch.equal(dst[:65536], src[:65536])
    finally:
        await writer.aclose()
        await owner.aclose()


async def test_a_receive_abandoned_when_the_owner_closes_keeps_its_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's wait for the next write header ends with the connection; the header's buffer stays with the
    graveyard until UCX cancelled its receive, which the owner's close waits for: once closed, no request is
    kept (a kept one would keep the connection's endpoint, and that one the owner's listener)."""
    owner, writer, src, dst = await _pair({}, {})
    try:
        link = await writer.connect(owner.descriptor())
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)])
        buried = _record_burials(monkeypatch)
        for_good = len(GRAVEYARD.kept_for_good)
        await owner.aclose()
        headers = [r for _, n, r in buried if n == w.PREFIX.size]
        assert len(headers) == 1 and headers[0].completed  # buried with its request, cancelled by UCX
        assert not GRAVEYARD.posted_requests() and len(GRAVEYARD.kept_for_good) == for_good
        buried.clear()
    finally:
        await writer.aclose()
        await owner.aclose()
