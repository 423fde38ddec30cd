"""A plugin's ``register()`` that stalls (pinning a large buffer, a wedged engine) must not hold ``send()``
past a cancel or ``room_timeout``, and a registration that completes after ``send()`` left is undone.

Plugins run ``register()`` shielded (their engine's books must match what they pinned), as the
transport below does: before, ``send()`` also waited for it shielded, with no deadline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import anyio
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferAborted, TransferFailed, TransferTimeout
from aioembed.testing import MockTransport
from aioembed.transports.base import MemoryRegion

from ..session.conftest import LAYOUT, make_request
from . import test_failure_boundary as boundary
from .test_failure_boundary import _serves

pytestmark = pytest.mark.anyio

# No staging area: every send() registers the caller's tensors.
CFG = boundary.CFG.replace(staging_tokens=0, input_timeout=5.0)


class StallingRegister(MockTransport):
    """``register()`` waits (shielded, like a plugin's) until the test lets it go, once ``stall`` is set."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__()
        self.stall = False
        self.fail = fail
        self.entered = anyio.Event()
        self.go = anyio.Event()

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        if not self.stall:
            await super().register(regions)
            return
        with anyio.CancelScope(shield=True):
            self.entered.set()
            await self.go.wait()
            if self.fail:
                raise RuntimeError("the engine gave up pinning")
            await super().register(regions)


async def _stalled_send(sender: EmbeddingSender, writer: StallingRegister, room: str,
                        outcome: list[BaseException]) -> None:
    try:
        await sender.send(room, make_request(1500, 1))
    except BaseException as exc:
        outcome.append(exc)
        raise


@pytest.mark.parametrize("register_fails", [False, True])
async def test_a_cancelled_send_returns_while_register_stalls_and_the_registration_is_undone(
        register_fails: bool) -> None:
    writer = StallingRegister(fail=register_fails)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        staged_regions = len(writer.regions)
        handle = receiver.start("r")  # a rank that asked first
        writer.stall = True
        outcome: list[BaseException] = []
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_stalled_send, sender, writer, "r", outcome)
                await writer.entered.wait()
                tg.cancel_scope.cancel()  # the caller gives up while register() is stuck
        assert len(outcome) == 1 and isinstance(outcome[0], anyio.get_cancelled_exc_class()), outcome
        # The rank learns at once that the room is over (not at its input_timeout).
        with anyio.fail_after(2):
            with pytest.raises(TransferAborted, match="cancelled"):
                await handle.result()
        # The source is still held: its registration is under way and may pin it.
        assert sender.sources_held == 1 and not writer.go.is_set()
        writer.go.set()
        with anyio.fail_after(5):
            while sender.sources_held:
                await anyio.sleep(0.01)
        assert len(writer.regions) == staged_regions, "the late registration was not undone"
        writer.stall = False
        await _serves(sender, receiver, "next")


async def test_room_timeout_bounds_a_stalled_register() -> None:
    writer = StallingRegister()
    async with EmbeddingSender(LAYOUT, dataclasses.replace(CFG, room_timeout=1.0), transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        handle = receiver.start("r")
        writer.stall = True
        with anyio.fail_after(5):
            with pytest.raises(TransferTimeout, match="did not register the source within room_timeout") as err:
                await sender.send("r", make_request(1500, 1))
        assert err.value.phase == "room"
        with anyio.fail_after(2), pytest.raises(TransferFailed, match="did not register"):
            await handle.result()
        writer.go.set()
        with anyio.fail_after(5):
            while sender.sources_held:
                await anyio.sleep(0.01)
        assert len(writer.regions) == 0
        writer.stall = False
        await _serves(sender, receiver, "next")
