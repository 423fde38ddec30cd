"""The sender: in a room of several ranks, a rank that already holds every token (its final STATUS
went out) and whose session then ends (its receiver went silent for a while: a long stall on a busy rank, a
restart) is not a cause for the room to fail: no write goes to it any more, and ``send()`` returns once every
expected rank holds every token (README, "Failure semantics")."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack

import anyio
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferConfig, TransferError
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


async def _one_sender_two_ranks(stack: AsyncExitStack, faults: Callable[[WriteCall], WriteFault | None],
                                rank0_transport: MockTransport,
                                ) -> tuple[EmbeddingSender, EmbeddingReceiver, EmbeddingReceiver]:
    """A sender writing through ``faults``; rank 0 takes a room in one round, rank 1 in 128-token rounds (so it
    finishes long after rank 0). Both connected."""
    sender = await stack.enter_async_context(EmbeddingSender(LAYOUT, BASE, transport=MockTransport(faults=faults)))
    rank0 = await stack.enter_async_context(EmbeddingReceiver(
        LAYOUT, BASE.replace(default_tokens=2048), connect=sender.address, rank=0, world=2,
        transport=rank0_transport))
    rank1 = await stack.enter_async_context(EmbeddingReceiver(
        LAYOUT, BASE.replace(default_tokens=128, max_round_tokens=128, resume_reserve_tokens=0),
        connect=sender.address, rank=1, world=2, transport=MockTransport()))
    await rank0.wait_connected()
    await rank1.wait_connected()
    return sender, rank0, rank1


async def test_a_finished_ranks_lost_session_does_not_fail_the_room_for_the_others() -> None:
    slow = 0.5

    def faults(call: WriteCall) -> WriteFault | None:
        return WriteFault(delay=slow)  # every round takes a while: rank 1's ten rounds outlast rank 0's one

    async with AsyncExitStack() as stack:
        sender, rank0, rank1 = await _one_sender_two_ranks(stack, faults, MockTransport())
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


async def test_a_finished_rank_asking_again_in_a_new_session_is_told_why_while_the_others_are_served() -> None:
    """Rank 0 got the whole room, but (in real life) its session ended before the final STATUS reached it, and it
    asks again in its next session while rank 1 is still being served. Its INIT was refused as a duplicate (a bad
    frame, with a protocol-violation warning at the sender); it is now told, in a FAILED STATUS, why its rows are
    not sent again. Rank 1 is served to the end and ``send()`` returns."""
    from aioembed.protocol.messages import Init, Ping, Reject, Resume, Status, TransferStatus, Welcome

    from .rawpeer import RawReceiver, raw_receiver

    cfg = BASE.replace(heartbeat_interval=0.2, heartbeat_misses=5)

    async def keep_alive(raw: RawReceiver, first: int) -> None:
        for nonce in range(first, first + 10_000):
            raw.send(Ping(nonce=nonce))
            await anyio.sleep(0.05)

    async with EmbeddingSender(LAYOUT, cfg) as sender, raw_receiver(sender.address, LAYOUT, cfg) as a, \
            raw_receiver(sender.address, LAYOUT, cfg) as b:
        for raw, name, rank in ((a, "A", 0), (b, "B", 1)):
            raw.send(raw.hello(LAYOUT, cfg, receiver_id=name, rank=rank, world=2))
            await raw.expect(Welcome)
        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_alive, a, 1)
            tg.start_soon(keep_alive, b, 1)
            a.send(Init(room="x", blocks=tuple(range(8)), allocated_tokens=1024, expected_ranks=2))  # all of it
            b.send(Init(room="x", blocks=(0,), allocated_tokens=128, expected_ranks=2))  # a round of 128 tokens
            src = make_request(300, 7)
            sending = anyio.Event()

            async def send() -> None:
                await sender.send("x", src)
                sending.set()

            tg.start_soon(send)
            done = await a.expect(Status)
            assert isinstance(done, Status) and done.state is TransferStatus.SUCCESS, done
            first = await b.expect(Status)
            assert isinstance(first, Status) and first.state is TransferStatus.TRANSFERRING, first
            # Rank 0 again, in a new session (its receiver's next handshake replaces the old one) ...
            a.send(a.hello(LAYOUT, cfg, receiver_id="A", rank=0, world=2, epoch=2))
            await a.expect(Welcome)
            a.send(Init(room="x", blocks=tuple(range(8, 16)), allocated_tokens=1024, expected_ranks=2))
            told = await a.next()
            while not isinstance(told, Status | Reject):  # PONGs, the DRAINED of session 1
                told = await a.next()
            assert not isinstance(told, Reject), told  # was: REJECT bad_frame "duplicate INIT from rank 0"
            assert isinstance(told, Status) and told.state is TransferStatus.FAILED, told
            assert "rank 0 was sent every token of this room in an earlier session" in (told.error or "")
            # ... while rank 1 is served to the end.
            sent = 128
            for rnd in range(1, 3):
                rest = min(128, 300 - sent)
                b.send(Resume(room="x", round=rnd, sent_tokens=sent, blocks=(0,), allocated_tokens=rest))
                st = await b.expect(Status)
                assert isinstance(st, Status) and st.state in (TransferStatus.TRANSFERRING, TransferStatus.SUCCESS)
                sent = st.sent_tokens
            assert sent == 300 and st.state is TransferStatus.SUCCESS
            with anyio.fail_after(5):
                await sending.wait()
            tg.cancel_scope.cancel()


async def test_a_finished_rank_asking_again_in_the_same_session_gets_no_write_and_its_blocks_back() -> None:
    """Rank 0 received the whole room and, while rank 1 is still written, asks for the same room id again in the
    same session (a retry of its caller). The sender must not serve it again (rank 0's rows were sent; the new
    blocks would be written for a room that is over there): the new attempt fails at once, saying why, its blocks
    go back, and rank 1 is still served to the end."""
    peers: list[str] = []

    def faults(call: WriteCall) -> WriteFault | None:
        peers.append(call.peer)
        return WriteFault(delay=0.2)  # rank 1's rounds outlast rank 0's one

    async with AsyncExitStack() as stack:
        rank0_transport = MockTransport()
        sender, rank0, rank1 = await _one_sender_two_ranks(stack, faults, rank0_transport)
        src = make_request(1200, 7)
        h0, h1 = rank0.start("r"), rank1.start("r")
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "r", src)
            assert_same((await h0.result()).tensors, src)
            room = sender._rooms["r"]
            assert 1 not in room.finished, "rank 1 finished as early as rank 0: the test proves nothing"
            writes = len(peers)
            with anyio.fail_after(5), pytest.raises(TransferError) as info:
                await rank0.receive("r")
            assert "duplicate INIT from rank 0" in str(info.value), info.value  # refused, not served
            with anyio.fail_after(10):
                assert_same((await h1.result()).tensors, src)
        assert f"loopback:{rank0_transport.id[:8]}" not in peers[writes:], "rank 0 was written again"
        with anyio.fail_after(5):
            await rank0.allocator.wait_all_free()
        assert rank0.fenced_blocks == {} and rank0.rooms_in_flight == 0
