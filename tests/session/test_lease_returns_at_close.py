"""A lease released off the loop's thread just before the receiver closes (CPU pool).

A release from another thread (or a lease's finalizer) only queues its grants; the loop returns them at
its next release, reservation or heartbeat. The receiver's close ran none of these, so such grants were
never returned: the ledger kept them READABLE and the allocator short after ``aclose()``. (A CUDA lease
released with its fence pending while the receiver closes had the same fate through a refused spawn; that
needs a GPU and is not tested here.)
"""

from __future__ import annotations

import threading

import anyio
import pytest

from aioembed.config import TransferConfig
from aioembed.protocol.ownership import GrantState
from aioembed.samples import deterministic_request, standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender

pytestmark = pytest.mark.anyio

BS = 13
LAYOUT = standard_layout(32)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_lease_released_from_a_thread_before_close_goes_back() -> None:
    cfg = TransferConfig(transport="loopback", block_size=BS, default_tokens=8 * BS, max_round_tokens=8 * BS,
                         pool_tokens=96 * BS, resume_reserve_tokens=8 * BS, heartbeat_interval=60.0)
    async with EmbeddingSender(LAYOUT, cfg) as sender:
        receiver = EmbeddingReceiver(LAYOUT, cfg, connect=sender.address)
        async with receiver:
            await receiver.wait_connected()
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "a", deterministic_request(LAYOUT, 50, "a"))
                lease = await receiver.receive_leased("a")
            worker = threading.Thread(target=lease.release)  # a consumer thread lets go of it
            worker.start()
            worker.join()
            assert lease.released
        stats = receiver.allocator.stats
        assert not receiver.keeper.ledger.grants(state=GrantState.READABLE)
        assert stats.free == stats.total, stats
