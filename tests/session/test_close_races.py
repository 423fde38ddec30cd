"""Calls that race a side's close: a ``send()`` or ``receive()`` that starts while ``aclose()`` is in progress, or
after it, fails at once with an ``AioembedError`` that names its room, and leaves nothing behind (no room, no held
source, no block); one whose rows were still being prepared when the close began is aborted, not sent."""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest
import torch

from aioembed import (
    AioembedError,
    EmbeddingReceiver,
    EmbeddingSender,
    TransferAborted,
    TransferConfig,
    TransferError,
    TransportError,
)
from aioembed.testing import MockTransport, WriteFault

from .conftest import LAYOUT, make_request

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, input_timeout=30.0, staging_tokens=0)


async def test_send_and_receive_after_close_fail_at_once_naming_the_room() -> None:
    sender = EmbeddingSender(LAYOUT, CFG)
    async with sender:
        receiver = EmbeddingReceiver(LAYOUT, CFG, connect=sender.address)
        async with receiver:
            await receiver.wait_connected()
        with anyio.fail_after(2), pytest.raises(AioembedError, match="room 'late-r': the receiver is closing"):
            await receiver.receive("late-r")
        with pytest.raises(AioembedError, match="room 'late-r2': the receiver is closing"):
            receiver.start("late-r2")
        assert receiver.rooms_in_flight == 0
    with anyio.fail_after(2), pytest.raises(AioembedError, match="room 'late-s': the sender is closing"):
        await sender.send("late-s", make_request(100, 1))
    assert sender.rooms_in_flight == 0 and sender.sources_held == 0


async def test_a_send_preparing_its_rows_as_the_sender_closes_is_aborted_and_holds_nothing() -> None:
    """Its rows are made contiguous off the loop (a large non-contiguous tensor) while ``aclose()`` runs: the room
    was not yet in the sender's table, so the close could not fail it; it is aborted once they are ready, not
    left waiting ``input_timeout`` for an INIT on a closed sender."""
    sender = EmbeddingSender(LAYOUT, CFG)
    src = make_request(40000, 2)
    src["embeddings"] = torch.cat([src["embeddings"], src["embeddings"]], dim=1)[:, ::2]  # 5 MB, strided
    assert not src["embeddings"].is_contiguous()
    outcome: list[BaseException] = []
    async with sender:
        async def send() -> None:
            try:
                await sender.send("prep", src)
            except TransferAborted as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            await anyio.wait_all_tasks_blocked()  # send() is in its copy off the loop (or waits for an INIT)
            with anyio.fail_after(10):
                await sender.aclose()
    assert len(outcome) == 1 and "'prep'" in str(outcome[0]) and "sender closing" in str(outcome[0]), outcome
    assert sender.rooms_in_flight == 0 and sender.sources_held == 0


@pytest.mark.parametrize(("tokens", "unregistered"), [(64, False), (2000, False), (2000, True)],
                         ids=["staged", "registered", "read-unregistered"])
async def test_the_senders_close_lets_go_of_the_sources_of_writes_that_may_still_land(tokens: int,
                                                                                       unregistered: bool) -> None:
    """A failed write that may still land holds its source (staged rows, the caller's registered tensors, or the
    caller's tensors read unregistered) for its transport's write lifetime. Once the sender's close has closed the
    transport nothing reads it any more: the closed sender holds nothing (it kept the caller's tensors, its staged
    rows and ``sources_held`` for as long as it was referenced)."""
    writer = MockTransport(cancel_safe_writes=False, write_lifetime=60.0, unregistered_sources=unregistered,
                           faults=lambda call: WriteFault(error=TransportError("link dropped", may_land=True)))
    cfg = CFG.replace(staging_tokens=512, staging_max_tokens=256, input_timeout=5.0)
    sender = EmbeddingSender(LAYOUT, cfg, transport=writer)
    failures: list[str] = []  # messages only: an exception's traceback would hold the rows in its frames
    async with sender, EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        src = make_request(tokens, 3)
        refs = [weakref.ref(t) for t in src.values()]

        async def send(rows: dict[str, torch.Tensor]) -> None:
            try:
                await sender.send("r", rows)
            except TransferError as exc:
                failures.append(str(exc))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send, src)
            with pytest.raises(TransferError):
                await receiver.receive("r")
        del src
        assert failures and sender.sources_held == 1  # held for the write lifetime (60 s)
    gc.collect()
    assert sender.sources_held == 0
    assert all(r() is None for r in refs), "the closed sender still holds the caller's tensors"
    assert sender._staging is None or sender._staging.used == 0
