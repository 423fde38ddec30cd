"""The owner's memory for inbound connections is bounded per endpoint, not per connection.

Each connection's write headers in progress were bounded (64 MiB, :mod:`aioembed_ucx._body_budget`), but neither
the number of connections a listener took nor their headers together: N peers could hold N x 64 MiB until
``write_timeout``. Now all connections' headers share the endpoint's budget (``TRANSPORT_BODY_BUDGET``), and a
listener takes at most ``max_connections`` connections at once, closing further ones before their handshake."""

from __future__ import annotations

import asyncio
import logging
import time
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch
from aioembed.errors import TransportError
from aioembed.testing import region_of
from aioembed.transports.base import Link, Transport, WriteOp
from aioembed.transports.registry import open_transport

from aioembed_ucx import _wire as w
from aioembed_ucx import transport as ucx_module
from aioembed_ucx._progress import tag_send

from .conftest import UCX_OPTIONS, ucx_link, ucx_transport

pytestmark = pytest.mark.anyio

MiB = 1 << 20
SIZE = 1 << 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _write_checked(t: Transport, link: Link, src: torch.Tensor, dst: torch.Tensor, offset: int) -> None:
    """One write of 4 KiB at ``offset``, then the bytes compared."""
    await link.write([WriteOp(src.data_ptr() + offset, dst.data_ptr() + offset, 4096)])
    assert torch.equal(dst[offset:offset + 4096], src[offset:offset + 4096])


async def _until(condition: Any, seconds: float) -> None:
    with anyio.fail_after(seconds):
        while not condition():
            await asyncio.sleep(0.02)


@asynccontextmanager
async def _owner_and_writers(owner_options: dict[str, Any], writers: int, size: int
                             ) -> AsyncIterator[tuple[Transport, list[Transport], torch.Tensor, torch.Tensor]]:
    """An owner with ``dst`` registered and ``writers`` endpoints with ``src`` registered (``size`` bytes each),
    all closed on leaving."""
    owner = await open_transport("ucx", dict(UCX_OPTIONS, **owner_options))
    ends: list[Transport] = [await open_transport("ucx", dict(UCX_OPTIONS)) for _ in range(writers)]
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)
    try:
        await owner.register([region_of(dst)])
        for t in ends:
            await t.register([region_of(src)])
        yield owner, ends, src, dst
    finally:
        for t in ends:
            await t.aclose()
        await owner.aclose()


async def test_connections_past_max_connections_are_refused_at_once_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two connections open, three more are refused: each writer's connect fails at once (not after its
    connect_timeout) with a TransportError naming the option; one warning line for the three; a slot that frees
    up takes the next writer, whose write lands."""
    caplog.set_level(logging.WARNING, logger="aioembed.transports.ucx")
    async with _owner_and_writers({"max_connections": 2}, 5, SIZE) as (owner, writers, src, dst):
        plugin = ucx_transport(owner)
        descriptor = owner.descriptor()
        links = [await t.connect(descriptor) for t in writers[:2]]
        for k, link in enumerate(links):
            await _write_checked(writers[k], link, src, dst, k * 4096)
        assert plugin.connections == 2 and plugin.connections_refused == 0
        for t in writers[2:]:
            start = time.monotonic()
            with pytest.raises(TransportError, match="max_connections") as refused:
                await t.connect(descriptor)
            assert time.monotonic() - start < 2.0 < UCX_OPTIONS["connect_timeout"]
            assert "cannot connect" in str(refused.value) and not refused.value.may_land
        assert plugin.connections == 2 and plugin.connections_refused == 3
        warnings = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(warnings) == 1, warnings  # rate-limited: one line for the storm
        assert "max_connections=2" in warnings[0] and "transport_options.max_connections" in warnings[0]
        # The two served connections go on working.
        await _write_checked(writers[1], links[1], src, dst, 2 * 4096)
        await links[0].aclose()  # the writer aborts its endpoint: the owner's slot frees up
        await _until(lambda: plugin.connections == 1, 10)
        link = await writers[2].connect(descriptor)
        await _write_checked(writers[2], link, src, dst, 3 * 4096)
        assert plugin.connections == 2 and plugin.connections_refused == 3
    assert plugin.connections == 0 and plugin.connections_refused == 3  # the count outlives the listener


async def test_headers_of_all_connections_share_the_endpoints_budget(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Three connections each send four prefixes of 1 MiB bodies that never come. Each connection may hold 2 MiB
    (its budget), but the endpoint holds 3 MiB at most: whoever comes later waits, reading nothing more, and a
    connection that holds nothing is dropped at ``write_timeout`` as the others are. Then every writer's next
    write lands over a new connection."""
    caplog.set_level(logging.WARNING, logger="aioembed.transports.ucx")
    monkeypatch.setattr(ucx_module, "BODY_BUDGET", 2 * MiB)
    monkeypatch.setattr(ucx_module, "TRANSPORT_BODY_BUDGET", 3 * MiB)
    async with _owner_and_writers({"write_timeout": 1.0}, 3, MiB) as (owner, writers, src, dst):
        plugin = ucx_transport(owner)
        links: list[Link] = []
        for k, t in enumerate(writers):
            links.append(await t.connect(owner.descriptor()))
            await _write_checked(t, links[-1], src, dst, k * 4096)  # the connection is up and serving
        assert plugin.connections == 3 and plugin.body_bytes_held == 0
        for link in links:
            ep: Any = ucx_link(link)._ep
            assert ep is not None
            for i in range(4):
                await tag_send(ep, w.PREFIX.pack(w.MAGIC, w.VERSION, w.KIND_WRITE, 1_000_000 + i, MiB), w.T_PREFIX)
        await _until(lambda: plugin.body_bytes_held >= 3 * MiB, 5)
        await asyncio.sleep(0.3)  # time enough to take more, were it allowed
        assert plugin.body_bytes_held == 3 * MiB
        assert plugin._body_budget.held == 3 * MiB
        # The stall timeout (1 s) ends every connection: those with writes in progress and the one waiting.
        await _until(lambda: not plugin._server_eps and plugin.connections == 0 and plugin.body_bytes_held == 0,
                     10)
        assert any("room for its" in r.getMessage() for r in caplog.records)
        dst.zero_()
        for k, (t, link) in enumerate(zip(writers, links, strict=True)):
            with anyio.fail_after(10):
                while True:  # the writer may first learn of the drop from a failed write
                    try:
                        await _write_checked(t, link, src, dst, k * 4096)
                        break
                    except TransportError:  # the dropped connection; the next write makes a new one
                        await asyncio.sleep(0.05)
        assert plugin.body_bytes_held == 0 and plugin.connections == 3


def test_a_body_announcing_more_ops_than_allowed_is_refused_before_it_is_unpacked() -> None:
    body = w.encode_ops([(4096 + i, 1) for i in range(3)], [(8192, 2), (8200, 2)])
    assert w.decode_ops(body, 5) == ([(4096, 1), (4097, 1), (4098, 1)], [(8192, 2), (8200, 2)])
    with pytest.raises(ValueError, match="announces 5 ops, more than 4"):
        w.decode_ops(body, 4)
    n = (w.MAX_BODY - w.BODY_HEAD.size) // 16
    big = bytearray(w.BODY_HEAD.pack(n, 0)) + bytearray(16 * n)  # 4 Mi ops: ~370 MiB of tuples once unpacked
    tracemalloc.start()
    try:
        with pytest.raises(w.TooManyOps, match=f"announces {n} ops"):
            w.decode_ops(big, 1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MiB  # nothing unpacked (that is hundreds of MiB of Python objects)


async def test_a_write_of_more_ops_than_registered_bytes_is_refused_and_the_link_goes_on() -> None:
    """4097 one-byte ops into 4096 registered bytes must overlap: refused before they are decoded, with nothing
    written; the link stays usable. (Not eager: an eager write's ops are bounded by ``eager_bytes`` instead.)"""
    owner = await open_transport("ucx", dict(UCX_OPTIONS))
    writer = await open_transport("ucx", dict(UCX_OPTIONS, eager_bytes=0))
    src = torch.randint(1, 256, (2 * 4096,), dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    try:
        await writer.register([region_of(src)])
        await owner.register([region_of(dst)])
        link = await writer.connect(owner.descriptor())
        refused = r"refused the write: .*announces 4097 ops, more than 4096: more ops than the bytes registered"
        with pytest.raises(TransportError, match=refused):
            await link.write([WriteOp(src.data_ptr() + i, dst.data_ptr(), 1) for i in range(4097)])
        assert int(dst.count_nonzero()) == 0
        await _write_checked(writer, link, src, dst, 0)
        assert ucx_transport(owner).writes_received == 1
    finally:
        await writer.aclose()
        await owner.aclose()
