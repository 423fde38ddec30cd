"""Write headers a peer announces are bounded per connection (:class:`aioembed_ucx._body_budget.BodyBudget`).

A peer sending write prefixes alone, each announcing a body of up to ``MAX_BODY`` (64 MiB), made the owner
allocate each body at once, without end: a hostile or broken writer could take the owner's memory."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest
import torch
from aioembed.errors import TransportError
from aioembed.testing import region_of
from aioembed.transports.base import Link, WriteOp
from aioembed.transports.registry import open_transport

from aioembed_ucx import _wire as w
from aioembed_ucx import transport as ucx_module
from aioembed_ucx._body_budget import BodyBudget
from aioembed_ucx._progress import tag_send
from aioembed_ucx.transport import UcxLink, UcxTransport

from .conftest import UCX_OPTIONS, ucx_link, ucx_transport

pytestmark = pytest.mark.anyio

MiB = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_budget_holds_up_to_its_limit_and_waiters_go_on_as_it_is_given_back() -> None:
    changes: list[int] = []
    budget = BodyBudget(10, changes.append)
    await budget.take(6)
    await budget.take(4)
    assert budget.held == 10
    assert not budget.try_take(1) and budget.held == 10  # no room now: nothing held for it
    late = asyncio.ensure_future(budget.take(3))
    await asyncio.sleep(0.01)
    assert not late.done() and budget.held == 10  # spent: the next body waits
    budget.give(4)
    await asyncio.wait_for(late, 1)
    assert budget.held == 9 and changes == [6, 4, -4, 3]
    budget.give(6)
    budget.give(3)
    await budget.take(10)  # a body of the whole limit fits once nothing is held
    assert budget.held == 10
    for bad in (-1, 11):
        with pytest.raises(ValueError, match="nbytes"):
            await budget.take(bad)
    with pytest.raises(ValueError, match="given back"):
        budget.give(11)
    with pytest.raises(ValueError, match="limit"):
        BodyBudget(0)


async def test_prefixes_without_bodies_hold_one_budget_and_the_connection_is_dropped_at_its_stall(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight prefixes of 1 MiB bodies that never come: the owner holds two of them (its 2 MiB budget) and reads
    no more from that peer; at ``write_timeout`` without progress it drops the connection and gives them back.
    The writer's next write goes over a new connection, whole."""
    monkeypatch.setattr(ucx_module, "BODY_BUDGET", 2 * MiB)
    owner = await open_transport("ucx", dict(UCX_OPTIONS, write_timeout=1.0))
    writer = await open_transport("ucx", dict(UCX_OPTIONS))
    src = torch.randint(0, 256, (MiB,), dtype=torch.uint8)
    dst = torch.zeros(MiB, dtype=torch.uint8)
    try:
        await writer.register([region_of(src)])
        await owner.register([region_of(dst)])
        link: Link = await writer.connect(owner.descriptor())
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)])  # the connection is up and serving
        inner: UcxLink = ucx_link(link)
        plugin: UcxTransport = ucx_transport(owner)
        ep: Any = inner._ep
        assert ep is not None and plugin.body_bytes_held == 0
        for k in range(8):
            await tag_send(ep, w.PREFIX.pack(w.MAGIC, w.VERSION, w.KIND_WRITE, 1_000_000 + k, MiB), w.T_PREFIX)
        with anyio.fail_after(5):
            while plugin.body_bytes_held < 2 * MiB:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # time enough to read the other six prefixes, were they read
        assert plugin.body_bytes_held == 2 * MiB
        with anyio.fail_after(10):  # the stall timeout (1 s) ends the connection and its writes
            while plugin._server_eps or plugin.body_bytes_held:
                await asyncio.sleep(0.05)
        dst.zero_()
        with anyio.fail_after(10):
            while True:  # the writer may first learn of the drop from a failed write
                try:
                    await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), MiB)])
                    break
                except TransportError:  # the dropped connection; the next write makes a new one
                    await asyncio.sleep(0.05)
        assert torch.equal(dst, src)
        assert plugin.body_bytes_held == 0
    finally:
        await writer.aclose()
        await owner.aclose()
