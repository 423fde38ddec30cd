"""The sender: in a room of several ranks, a rank that already holds every token (its final STATUS
went out) and whose session then ends (its receiver went silent for a while: a long stall on a busy rank, a
restart) is not a cause for the room to fail: no write goes to it any more, and ``send()`` returns once every
expected rank holds every token (README, "Failure semantics")."""

from __future__ import annotations

from contextlib import AsyncExitStack

import anyio
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferConfig
from aioembed.session.liveness import PeerClock
from aioembed.testing import MockTransport, WriteCall, WriteFault

from ..session.conftest import LAYOUT, assert_same, make_request

pytestmark = pytest.mark.anyio


class _Silent(PeerClock):
    """A peer's clock that hears nothing more: its receiver is stalled (the liveness loop then ends it)."""

    def heard(self, now: float) -> None:
        pass


BASE = TransferConfig(block_size=128, pool_tokens=4096, default_tokens=2048, handshake_timeout=2.0,
                      input_timeout=10.0, round_timeout=10.0, heartbeat_interval=0.1, staging_tokens=0)


async def test_a_finished_ranks_lost_session_does_not_fail_the_room_for_the_others() -> None:
    slow = 0.5

    def faults(call: WriteCall) -> WriteFault | None:
        return WriteFault(delay=slow)  # every round takes a while: rank 1's ten rounds outlast rank 0's one

    async with AsyncExitStack() as stack:
        sender = await stack.enter_async_context(
            EmbeddingSender(LAYOUT, BASE, transport=MockTransport(faults=faults)))
        rank0 = await stack.enter_async_context(EmbeddingReceiver(
            LAYOUT, BASE.replace(default_tokens=2048), connect=sender.address, rank=0, world=2,
            transport=MockTransport()))
        rank1 = await stack.enter_async_context(EmbeddingReceiver(
            LAYOUT, BASE.replace(default_tokens=128, max_round_tokens=128, resume_reserve_tokens=0),
            connect=sender.address, rank=1, world=2, transport=MockTransport()))
        await rank0.wait_connected()
        await rank1.wait_connected()
        src = make_request(1200, 7)
        h0, h1 = rank0.start("r"), rank1.start("r")
        outcome: list[BaseException | None] = []

        async def send() -> None:
            try:
                await sender.send("r", src)
                outcome.append(None)
            except Exception as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            got0 = await h0.result()  # rank 0 holds every token
            assert_same(got0.tensors, src)
            room = sender._rooms["r"]
            assert 1 not in room.finished, "rank 1 finished as early as rank 0: the test proves nothing"
            peer0 = room.rank_peer[0]
            peer0.clock = _Silent(peer0.clock.last_heard)  # rank 0's receiver is silent from here (a stall)
            with anyio.fail_after(10):
                got1 = await h1.result()
            assert not peer0.alive, "rank 0's session did not end while rank 1 was written: the test proves nothing"
        assert_same(got1.tensors, src)
        assert outcome == [None], outcome
