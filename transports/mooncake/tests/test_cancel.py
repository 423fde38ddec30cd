"""A write of many engine batches stops at its next batch once cancelled (a room's deadline, a cancelled
``send()``, the sender closing): its waits for transfers are shielded, and submits to a warm link do not
yield, so the take of each batch's credits is where it learns."""

from __future__ import annotations

import anyio
import pytest
import torch
from aioembed.transports.base import MemoryRegion, WriteOp

from aioembed_mooncake import MooncakeTransport

pytestmark = pytest.mark.anyio

OPTIONS = {"protocol": "tcp", "hostname": "127.0.0.1", "max_batch_ops": 1, "max_batch_bytes": 64 << 10}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_cancelled_write_of_many_batches_stops_at_the_next_batch() -> None:
    n = 32 << 20  # 512 batches of one 64 KiB transfer, each waited for before the next
    src = torch.randint(1, 255, (n,), dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    async with await MooncakeTransport.open(OPTIONS) as a, await MooncakeTransport.open(OPTIONS) as b:
        await a.register([MemoryRegion.of_tensor(src)])
        await b.register([MemoryRegion.of_tensor(dst)])
        link = await a.connect(b.descriptor())
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)])  # warm: submits no longer yield
        dst.zero_()
        with anyio.move_on_after(0.005) as scope:
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), n)])
        assert scope.cancelled_caught, "the write ran to its end through its cancellation"
        landed = int((dst.view(-1, 64 << 10) != 0).any(1).sum())
        assert landed < n // (64 << 10)
        assert a._poller.pending == 0  # what was submitted ended before the write gave up: nothing may land
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)])  # the link goes on
        assert torch.equal(dst[:4096], src[:4096])
