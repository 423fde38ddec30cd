"""The sender: a ``send()`` cancelled while it prepares its rows (a large non-contiguous CPU copy
off the loop, a CUDA producer's stream being waited for) must abort the room on both sides, as a cancel at
any later await does (README, "Failure semantics": cancelling ``send()`` aborts the room on both sides)."""

from __future__ import annotations

import time

import anyio
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferAborted, TransferConfig
from aioembed.session import sender as sender_module
from aioembed.testing import MockTransport

from ..session.conftest import LAYOUT, make_request, room_goes_through

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, handshake_timeout=2.0, input_timeout=20.0,
                     heartbeat_interval=0.5)


async def test_cancel_while_send_prepares_rows_aborts_the_waiting_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank asked for the room; its send() is cancelled while it waits for its rows to be ready: the rank
    learns at once (TransferAborted), not after input_timeout, and the sender forgets the room."""
    entered, release = anyio.Event(), anyio.Event()
    real = sender_module.wait_fence

    async def slow_fence(fence, limiter=None):  # type: ignore[no-untyped-def]
        entered.set()  # a producer stream not done yet
        await release.wait()
        await real(fence, limiter)

    async with EmbeddingSender(LAYOUT, CFG, transport=MockTransport()) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        handle = receiver.start("r")
        with anyio.fail_after(5):
            while "r" not in sender._rooms:
                await anyio.sleep(0.01)
        monkeypatch.setattr(sender_module, "wait_fence", slow_fence)
        async with anyio.create_task_group() as tg:
            async def send() -> None:
                await sender.send("r", make_request(1500, 1))  # more than the staging area takes

            tg.start_soon(send)
            await entered.wait()
            tg.cancel_scope.cancel()
        monkeypatch.setattr(sender_module, "wait_fence", real)
        t0 = time.monotonic()
        with anyio.fail_after(10), pytest.raises(TransferAborted):
            await handle.result()
        took = time.monotonic() - t0
        assert took < 3.0, f"the receiver learned of the cancelled send() after {took:.1f} s"
        with anyio.fail_after(5):
            while sender.rooms_in_flight or sender.sources_held:
                await anyio.sleep(0.01)
        await room_goes_through(sender, receiver, "next", 1500, 2)
