"""A cancelled ``receive(out=...)`` returns only once nothing copies into ``out`` any more: the caller
reuses those buffers for its next request as soon as the call returned."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import anyio
import pytest
import torch

from aioembed import EmbeddingReceiver, EmbeddingSender, Part, TransferConfig, TransferError

from .conftest import LAYOUT, make_request

pytestmark = pytest.mark.anyio

N = 32768  # 5 MB of rows: copied out in a thread (smaller copies run on the loop)
CFG = TransferConfig(default_tokens=N, pool_tokens=N, resume_reserve_tokens=0, copy_chunk_tokens=0, copy_threads=1,
                     output_cache_bytes=0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("parts", [False, True], ids=["one sender", "parts"])
async def test_a_cancelled_receive_returns_after_its_last_write_into_out(parts: bool) -> None:
    src = make_request(N, 3)
    async with EmbeddingSender(LAYOUT, CFG) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address) as receiver:
        await receiver.wait_connected()
        pool, copy_out = receiver.pool, receiver.pool.copy_out
        copying, copied = threading.Event(), []  # copies ended

        def slow_copy_out(*args: Any, **kwargs: Any) -> Any:
            copying.set()
            time.sleep(0.3)  # the caller gives up while its rows are being copied
            try:
                return copy_out(*args, **kwargs)
            finally:
                copied.append(1)

        pool.copy_out = slow_copy_out  # type: ignore[method-assign]
        out = LAYOUT.empty(N)
        copies_ended_at_return: list[int] = []

        async def receive(scope: anyio.CancelScope) -> None:
            with scope:
                if parts:
                    await receiver.receive("r", out=out, parts=[Part(sender.address, 0, N)])
                else:
                    await receiver.receive("r", out=out)
            copies_ended_at_return.append(len(copied))

        async def send() -> None:
            with contextlib.suppress(TransferError):  # the receiver ended the room
                await sender.send("r", src, part=0 if parts else None)

        scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive, scope)
            tg.start_soon(send)
            await anyio.to_thread.run_sync(copying.wait)
            scope.cancel()
        assert copies_ended_at_return == [1], "receive() returned while its copy into out= was still running"
        for t in out.values():
            t.zero_()  # the caller's next request reuses the buffers
        await anyio.sleep(0.5)
        assert all(int(torch.count_nonzero(t)) == 0 for t in out.values()), "the reused out= was written"
