"""Calls that race a side's close: a ``send()`` or ``receive()`` that starts while ``aclose()`` is in progress, or
after it, fails at once with an ``AioembedError`` that names its room, and leaves nothing behind (no room, no held
source, no block); one whose rows were still being prepared when the close began is aborted, not sent."""

from __future__ import annotations

import anyio
import pytest
import torch

from aioembed import AioembedError, EmbeddingReceiver, EmbeddingSender, TransferAborted, TransferConfig

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
