"""The plugin boundary: a stray ``asyncio.CancelledError`` from a plugin is a plugin failure.

On asyncio a plugin that awaits one of its own futures which it (or its engine's close) cancelled raises
``CancelledError`` in a task nobody cancelled. That is not a cancellation of the caller: it must reach the
session as a ``TransportError`` (a write: one that may still land), as any other plugin exception does. It
escaped the boundary; inside a round written chunk by chunk, anyio's task group swallowed it and the round
counted as landed: ``send()`` returned and ``receive()`` succeeded with rows that never arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
import pytest
import torch

from aioembed import EmbeddingReceiver, EmbeddingSender, Field, Layout, TransferConfig, TransferError
from aioembed.errors import TransportError
from aioembed.testing import MockTransport, WriteFault
from aioembed.testing.mock import WriteCall
from aioembed.transports.base import Link, WriteOp
from aioembed.transports.boundary import GuardedLink

pytestmark = pytest.mark.anyio

LAYOUT = Layout(e=Field((64,), torch.float32))
CFG = TransferConfig(pool_tokens=16384, default_tokens=8192, staging_tokens=0, status_inline_bytes=0,
                     input_timeout=5, round_timeout=5, room_timeout=10)


class _Link(Link):
    def __init__(self, exc: BaseException | None) -> None:
        self.exc = exc

    @property
    def peer(self) -> str:
        return "test-peer"

    async def write(self, ops: Sequence[WriteOp]) -> None:
        if self.exc is not None:
            raise self.exc
        await anyio.sleep_forever()

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_stray_asyncio_cancel_from_a_write_is_a_transport_error_that_may_land() -> None:
    link = GuardedLink(_Link(asyncio.CancelledError("the engine cancelled its own request")), "test")
    with pytest.raises(TransportError, match="CancelledError") as info:
        await link.write([])
    assert info.value.may_land is True
    assert isinstance(info.value.__cause__, asyncio.CancelledError)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_real_cancellation_still_goes_through_the_boundary() -> None:
    link = GuardedLink(_Link(None), "test")
    with anyio.move_on_after(0.05) as scope:
        await link.write([])
    assert scope.cancelled_caught


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the end-to-end cases: a stray asyncio.CancelledError is an asyncio thing


def _stray_cancel_on(index: int):  # type: ignore[no-untyped-def]
    def faults(call: WriteCall) -> WriteFault | None:
        if call.index == index:  # never lands
            return WriteFault(error=asyncio.CancelledError("plugin cancelled its own request"), land_after=None)
        return None
    return faults


@pytest.mark.parametrize(("tokens", "failing_write"), [(100, 0), (6000, 1)], ids=["one-write", "chunked-round"])
async def test_a_stray_cancel_from_a_write_fails_the_room_on_both_sides(tokens: int, failing_write: int) -> None:
    sent: list[object] = []
    received: list[object] = []
    src = {"e": torch.randn(tokens, 64) + 5}
    async with EmbeddingSender(LAYOUT, CFG, bind="tcp://127.0.0.1:0",
                               transport=MockTransport(faults=_stray_cancel_on(failing_write))) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:

        async def send() -> None:
            try:
                await sender.send("x", src)
                sent.append("returned")
            except Exception as exc:
                sent.append(exc)

        async def receive() -> None:
            try:
                got = await receiver.receive("x")
                received.append(("success", torch.equal(got.tensors["e"], src["e"])))
            except Exception as exc:
                received.append(exc)

        with anyio.fail_after(8):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                tg.start_soon(receive)
    # Neither side was cancelled: both ended with the library's error, naming the plugin's failure.
    assert len(sent) == 1 and isinstance(sent[0], TransferError), sent
    assert "CancelledError" in str(sent[0])
    assert len(received) == 1 and isinstance(received[0], TransferError), received


async def test_a_stray_cancel_from_a_failed_writes_settled_leaves_the_sender_running() -> None:
    """``TransportError.settled`` is the plugin's own coroutine, awaited by a background task of the sender: a stray
    cancel out of it cancelled the sender's whole task host (its control socket included), silently; the next
    ``send()`` said the sender was not running."""

    async def settled() -> None:
        await anyio.sleep(0.01)
        raise asyncio.CancelledError("the engine cancelled its completion future")

    def faults(call: WriteCall) -> WriteFault | None:
        if call.index == 0:
            return WriteFault(error=TransportError("engine timed out", may_land=True, settled=settled))
        return None

    sender_transport = MockTransport(cancel_safe_writes=False, write_lifetime=0.05, faults=faults)
    async with EmbeddingSender(LAYOUT, CFG, bind="tcp://127.0.0.1:0", transport=sender_transport) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        for room, ok in (("a", False), ("b", True)):
            src = {"e": torch.randn(100, 64)}
            outcome: list[object] = []

            async def send(room: str = room, src: dict[str, torch.Tensor] = src,
                           outcome: list[object] = outcome) -> None:
                try:
                    await sender.send(room, src)
                    outcome.append("sent")
                except Exception as exc:
                    outcome.append(exc)

            with anyio.fail_after(8):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(send)
                    try:
                        got = await receiver.receive(room, expected_tokens=100)  # room a's blocks stay fenced
                        outcome.append(torch.equal(got.tensors["e"], src["e"]))
                    except TransferError as exc:
                        outcome.append(exc)
            if ok:
                assert sorted(map(str, outcome)) == ["True", "sent"], outcome
            else:
                assert all(isinstance(x, TransferError) for x in outcome), outcome
            await anyio.sleep(0.1)  # the failed write's settled() has come and gone
        assert sender._tasks.entered
