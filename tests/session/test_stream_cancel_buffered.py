"""A zero-copy stream whose ``__anext__`` is cancelled while chunks that already landed wait in its buffer:
they stay the caller's to take. (The first fix of the chunk a cancelled consumer dropped released the
buffered ones too, and the next ``__anext__`` handed out released chunks with empty views: found by a
review.) The docs: a failed stream yields the chunks that had landed, then raises."""
from __future__ import annotations

import contextlib

import anyio
import pytest

from aioembed.config import TransferConfig
from aioembed.errors import TransferError
from aioembed.samples import deterministic_request, standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender

pytestmark = pytest.mark.anyio
BS = 13
ROUND = 8 * BS
LAYOUT = standard_layout(32)


def _config() -> TransferConfig:
    return TransferConfig(transport="loopback", block_size=BS, default_tokens=ROUND, max_round_tokens=ROUND,
                          pool_tokens=12 * ROUND, resume_reserve_tokens=ROUND, stream_chunk_tokens=3 * BS,
                          input_timeout=30.0, round_timeout=30.0)


async def test_chunk_in_buffer_not_released_by_a_cancelled_anext() -> None:
    cfg = _config()
    src = deterministic_request(LAYOUT, ROUND, "buffered")  # one round
    async with EmbeddingSender(LAYOUT, cfg) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected()
        stream = receiver.stream("room", zero_copy=True)
        async with stream:
            async with anyio.create_task_group() as tg:
                async def send() -> None:
                    with contextlib.suppress(TransferError):
                        await sender.send("room", src)
                tg.start_soon(send)
                with anyio.fail_after(10):
                    while stream._chunks.statistics().current_buffer_used == 0:
                        await anyio.sleep(0.005)   # a chunk has landed and waits in the buffer
                with anyio.CancelScope() as scope:   # e.g. a move_on_after whose deadline already passed
                    scope.cancel()
                    await stream.__anext__()
                assert scope.cancelled_caught
                got = []
                try:
                    with anyio.fail_after(10):
                        async for chunk in stream:
                            views = {k: len(v) for k, v in chunk.views.items()}
                            got.append((chunk.start, chunk.end, chunk.released, views))
                except TransferError:
                    pass
            assert got, "nothing was handed out after the cancel"
            assert not any(released for _, _, released, _ in got), f"released chunks handed out: {got}"
