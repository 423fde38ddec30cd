"""``handle.cancel()`` on a zero-copy room that has just finished gives its untaken lease back (as
documented); a ``handle.lease()`` after it (or already woken by the room's end) then handed out that
released lease, with no views, instead of saying the room was cancelled."""

from __future__ import annotations

import anyio
import pytest

from aioembed.config import TransferConfig
from aioembed.errors import TransferAborted
from aioembed.samples import deterministic_request, standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender

pytestmark = pytest.mark.anyio

BS = 13
LAYOUT = standard_layout(32)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_lease_after_cancel_of_a_finished_room_raises() -> None:
    cfg = TransferConfig(transport="loopback", block_size=BS, default_tokens=8 * BS, max_round_tokens=8 * BS,
                         pool_tokens=96 * BS, resume_reserve_tokens=8 * BS)
    async with EmbeddingSender(LAYOUT, cfg) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected()
        handle = receiver.start("q", zero_copy=True)
        await sender.send("q", deterministic_request(LAYOUT, 50, "q"))
        await handle.wait()
        handle.cancel("a scheduler's deadline, just as the room finished")  # gives the lease back
        with pytest.raises(TransferAborted):
            await handle.lease()
        with anyio.fail_after(10):
            await receiver.allocator.wait_all_free()
