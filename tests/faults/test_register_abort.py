"""The sender's registration task (see test_register_stall.py): the room ending while a plugin's
``register()`` stalls (``abort()``, the receiver's ABORT) is acted on at once, and a cancel at the instant
the registration completes leaks nothing and unregisters once."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferAborted, TransferError
from aioembed.session.handle import ReceiveHandle
from aioembed.testing import MockTransport
from aioembed.transports.base import MemoryRegion

from ..session.conftest import LAYOUT, make_request
from .test_register_stall import CFG

pytestmark = pytest.mark.anyio


class SlowRegister(MockTransport):
    """register() takes `delay` seconds once `stall` is set, not cancellable (a plugin pinning a large buffer
    in a worker thread: anyio.to_thread.run_sync is not abandoned on cancel)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.stall = False
        self.delay = delay
        self.entered = anyio.Event()
        self.after_register = None

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        if self.stall:
            self.entered.set()
            with anyio.CancelScope(shield=True):
                await anyio.sleep(self.delay)
        await super().register(regions)
        if self.after_register is not None:
            self.after_register()


@asynccontextmanager
async def _send_stalled_in_register(sender: EmbeddingSender, receiver: EmbeddingReceiver,
                                    writer: SlowRegister) -> AsyncIterator[ReceiveHandle]:
    """A rank asked for room "r", and ``send("r")`` waits for a ``register()`` that stalls (how the room ends
    is the test's to check, through the rank)."""
    handle = receiver.start("r")
    while "r" not in sender._rooms:
        await anyio.sleep(0.01)
    writer.stall = True
    async with anyio.create_task_group() as tg:
        async def send() -> None:
            with contextlib.suppress(TransferError):
                await sender.send("r", make_request(1500, 1))
        tg.start_soon(send)
        await writer.entered.wait()
        yield handle


async def test_abort_during_a_stalled_register_tells_the_receiver_at_once() -> None:
    """sender.abort(room) while its send() waits for register(): the rank that asked should learn at once
    (abort()'s docstring: 'Ranks that already asked for it are told at once'); it waits for the register
    (or room_timeout) instead."""
    writer = SlowRegister(delay=6.0)
    async with EmbeddingSender(LAYOUT, dataclasses.replace(CFG, room_timeout=30.0), transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        async with _send_stalled_in_register(sender, receiver, writer) as handle:
            sender.abort("r", "encoder failed")
            t0 = time.monotonic()
            with pytest.raises(TransferAborted):
                await handle.result()
            took = time.monotonic() - t0
        assert took < 2.0, f"the receiver learned of abort() after {took:.1f} s"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("order", ["cancel_then_done", "done_then_cancel"])
async def test_cancel_at_the_instant_registration_completes(order: str) -> None:
    """The registration completes and send() is cancelled before it resumes: no leak, no double unregister."""
    writer = SlowRegister(delay=0.2)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        base = len(writer.regions)
        handle = receiver.start("r")
        writer.stall = True
        unregisters = []
        orig = writer.unregister

        async def counting(regions):  # type: ignore[no-untyped-def]
            unregisters.append(len(regions))
            await orig(regions)
        writer.unregister = counting  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            async def send() -> None:
                with anyio.CancelScope() as scope:
                    if order == "cancel_then_done":
                        writer.after_register = scope.cancel  # before done.set()
                    else:  # runs after the registration task's step (done set), before send() resumes
                        import asyncio
                        writer.after_register = lambda: asyncio.get_running_loop().call_soon(scope.cancel)
                    await sender.send("r", make_request(1500, 1))
            tg.start_soon(send)
        with anyio.fail_after(2), pytest.raises(TransferAborted):
            await handle.result()
        with anyio.fail_after(5):
            while sender.sources_held:
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)
        assert len(writer.regions) == base
        assert len(unregisters) == 1, unregisters


async def test_receiver_cancel_during_a_stalled_register_is_acknowledged_at_once() -> None:
    """A rank's ABORT (handle.cancel()) while the send() waits for register(): no write was started, so the
    ABORT_ACK can go at once; it waits for the register, and the rank's blocks stay fenced meanwhile."""
    writer = SlowRegister(delay=6.0)
    async with EmbeddingSender(LAYOUT, dataclasses.replace(CFG, room_timeout=30.0), transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        async with _send_stalled_in_register(sender, receiver, writer) as handle:
            handle.cancel("the client went away")
            t0 = time.monotonic()
            await handle.wait()
            with anyio.move_on_after(5):
                while receiver.allocator.stats.free != receiver.allocator.stats.total:
                    await anyio.sleep(0.01)
            took = time.monotonic() - t0
        assert took < 2.0, f"the rank's blocks came back {took:.1f} s after its ABORT"
