"""A zero-copy stream's consumer cancelled at the instant a chunk is handed to it.

anyio's memory object stream hands an item straight to a waiting receiver (``send_nowait`` sets the
receiver's slot and wakes it). On asyncio, a cancellation that reaches the receiver before it resumes
raises out of ``receive()`` and the item in that slot is dropped (anyio's own cancel scopes defer their
delivery to a task whose wait already completed, so they do not lose it; a plain ``Task.cancel()`` -- a
server aborting a request, ``asyncio.timeout``, ``wait_for`` -- does): a ``LeasedChunk`` was then neither
handed out nor left in the buffer, so ``RoomStream.aclose()`` did not release it and its blocks stayed
READABLE until the garbage collector ran its finalizer (a ``ResourceWarning``). Every chunk the driver
sent must come back when the stream ends early, deterministically.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import warnings
from typing import Any

import anyio
import pytest

from aioembed.config import TransferConfig
from aioembed.errors import TransferError
from aioembed.protocol.ownership import GrantState
from aioembed.samples import deterministic_request, standard_layout
from aioembed.session.receive_room import ReceiveRoomDriver
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender
from aioembed.session.stream import LeasedChunk

pytestmark = pytest.mark.anyio

BS = 13
ROUND = 8 * BS
LAYOUT = standard_layout(32)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the loss needs asyncio's own Task.cancel(); trio hands the item over


def _config() -> TransferConfig:
    return TransferConfig(transport="loopback", block_size=BS, default_tokens=ROUND, max_round_tokens=ROUND,
                          pool_tokens=12 * ROUND, resume_reserve_tokens=ROUND, stream_chunk_tokens=3 * BS,
                          input_timeout=30.0, round_timeout=30.0)


class _CancelAfterHandoff:
    """The room driver's send side of the stream: after the first chunk is handed straight to the waiting
    consumer, cancel the consumer (the cancellation reaches it before it resumes)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.consumer: asyncio.Task[None] | None = None
        self.handed: list[LeasedChunk] = []

    def send_nowait(self, item: Any) -> None:
        waiting = bool(self._inner._state.waiting_receivers)
        self._inner.send_nowait(item)
        if waiting and not self.handed and isinstance(item, LeasedChunk):
            self.handed.append(item)
            assert self.consumer is not None
            self.consumer.cancel()  # asyncio's own cancellation, as a server's request abort

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _readable_of(receiver: EmbeddingReceiver, room: str) -> int:
    return sum(len(g.blocks) for g in receiver.keeper.ledger.grants(state=GrantState.READABLE) if g.room == room)


async def test_chunk_handed_to_a_cancelled_consumer_is_released() -> None:
    cfg = _config()
    src = deterministic_request(LAYOUT, 5 * ROUND, "lost")
    got: list[LeasedChunk] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        async with EmbeddingSender(LAYOUT, cfg) as sender, \
                EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
            await receiver.wait_connected()
            stream = receiver.stream("room", zero_copy=True)
            driver = receiver._rooms["room"]
            assert isinstance(driver, ReceiveRoomDriver)
            sink = _CancelAfterHandoff(driver.stream)
            driver.stream = sink  # type: ignore[assignment]

            async def send() -> None:
                with contextlib.suppress(TransferError):  # the receiver aborts the room
                    await sender.send("room", src)

            async def consume() -> None:
                async with stream:
                    async for chunk in stream:
                        got.append(chunk)

            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                sink.consumer = asyncio.ensure_future(consume())
                with pytest.raises(asyncio.CancelledError):
                    await sink.consumer
            assert sink.handed, "no chunk was handed straight to a waiting consumer: the race was not exercised"
            assert not got  # cancelled before it resumed: the consumer never saw the chunk
            await stream.handle.wait()
            # The stream is closed and its room over: none of its chunks may still hold pool blocks.
            assert sink.handed[0].released, "the chunk handed to the cancelled consumer was not released"
            assert _readable_of(receiver, "room") == 0
            with anyio.fail_after(10):
                await receiver.allocator.wait_all_free()
        sink.handed.clear()
        gc.collect()
    leaked = [w for w in caught if issubclass(w.category, ResourceWarning) and "Lease" in str(w.message)]
    assert not leaked, [str(w.message) for w in leaked]
