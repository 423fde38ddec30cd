"""A room longer than its first reservation: the sender's TOTAL lets the receiver announce the next round (RESUME)
while the round before it is still being written, so that the sender writes it as soon as that one ended."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferAborted, TransferConfig, TransferFailed
from aioembed.errors import ProtocolError, TransportError
from aioembed.metrics import TransferObserver
from aioembed.protocol.room import SenderRoomState, WriteTask
from aioembed.session.block_keeper import BlockKeeper
from aioembed.session.send_room import SendRoomDriver
from aioembed.testing import MockTransport
from aioembed.testing.mock import WriteCall, WriteFault

from .conftest import LAYOUT, assert_same, make_request, wait_pools_free

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=8192, max_round_tokens=1024)
_Pair = tuple[EmbeddingSender, EmbeddingReceiver]


@pytest.fixture
def resumes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, str]]]:
    """(round, the sender's phase of that rank) for each RESUME the sender takes: WRITING (or READY) when it came
    early, while the round before it was written; AWAITING_RESUME when it came after that round's STATUS."""
    seen: list[tuple[int, str]] = []
    real = SenderRoomState.on_resume

    def on_resume(self: SenderRoomState, rank: int, **kw: Any) -> None:
        seen.append((kw["round"], self.ranks[rank].phase.name))
        real(self, rank, **kw)

    monkeypatch.setattr(SenderRoomState, "on_resume", on_resume)
    yield seen


def _slow_writes(seconds: float) -> MockTransport:
    return MockTransport(faults=lambda call: WriteFault(delay=seconds))


@asynccontextmanager
async def _pair(writer: MockTransport, cfg: TransferConfig = CFG, observer: TransferObserver | None = None
                ) -> AsyncIterator[_Pair]:
    """A sender writing through ``writer`` and a connected receiver."""
    async with EmbeddingSender(LAYOUT, cfg, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, transport=MockTransport(), connect=sender.address,
                              observer=observer) as receiver:
        await receiver.wait_connected()
        yield sender, receiver


async def _receive(receiver: EmbeddingReceiver, room: str, mode: str) -> tuple[dict[str, torch.Tensor], int]:
    if mode == "receive":
        got = await receiver.receive(room)
        return got.tensors, got.rounds
    if mode == "out":
        out = LAYOUT.empty(3000)
        got = await receiver.receive(room, out=out)
        return out, got.rounds
    lease = await receiver.receive_leased(room)
    try:
        return {n: t.clone() for n, t in lease.to_tensors().items()}, lease.rounds
    finally:
        lease.release()


@pytest.fixture
def aheads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The rounds whose write the sender started ahead, while the round before it was still being written."""
    started: list[int] = []
    real = SenderRoomState.start_ahead

    def start_ahead(self: SenderRoomState, rank: int) -> WriteTask:
        task = real(self, rank)
        started.append(task.round)
        return task

    monkeypatch.setattr(SenderRoomState, "start_ahead", start_ahead)
    yield started


@pytest.mark.parametrize("mode", ["receive", "out", "receive_leased"])
async def test_every_later_round_is_announced_and_written_while_the_one_before_it_is_written(
        mode: str, resumes: list[tuple[int, str]], aheads: list[int]) -> None:
    """Round 1 is written alongside round 0, round 2 alongside round 1 (made the slowest, so that round 2's RESUME,
    sent at round 0's STATUS, comes while it is written); the STATUS frames still come in order (the receiver's
    machine refuses any other)."""
    # Long enough that a loaded CI host starts the next write well inside them (with 30 ms for round 0, round 1's
    # write once started 31 ms after it there).
    slow = {0: 0.25, 1: 0.5}
    started: dict[int, float] = {}

    def fault(call: WriteCall) -> WriteFault:
        started[call.index] = time.monotonic()
        return WriteFault(delay=slow.get(call.index, 0.03))

    async with _pair(MockTransport(faults=fault)) as (sender, receiver):
        src = make_request(3000, seed=7)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "early", src)
            rows, rounds = await _receive(receiver, "early", mode)
        assert rounds == 3
        assert_same(rows, src)
        assert resumes == [(1, "WRITING"), (2, "WRITING")]
        assert aheads == [1, 2]
        # Not one write after another: each round's write started while the one before it was still being written
        # (the order of events, not a total time, which a loaded machine stretches).
        assert sorted(started) == [0, 1, 2]
        assert started[1] < started[0] + slow[0] and started[2] < started[1] + slow[1], started
        await wait_pools_free(sender, receiver)


async def test_a_pool_without_room_for_two_rounds_resumes_after_each_status(
        resumes: list[tuple[int, str]]) -> None:
    """The early reservation never waits for memory: a pool that holds one round at a time reserves the next one
    once the round before it was copied out and freed, as without TOTAL."""
    cfg = CFG.replace(pool_tokens=1024, resume_reserve_tokens=0)
    async with _pair(_slow_writes(0.01), cfg) as (sender, receiver):
        src = make_request(3000, seed=8)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "short", src)
            got = await receiver.receive("short")
        assert got.rounds == 3
        assert_same(got.tensors, src)
        assert resumes == [(1, "AWAITING_RESUME"), (2, "AWAITING_RESUME")]
        await wait_pools_free(sender, receiver)


async def test_a_stream_takes_its_rounds_one_after_another(resumes: list[tuple[int, str]]) -> None:
    """A stream hands its chunks out round by round: it announces no round early (the TOTAL is only noted)."""
    async with _pair(_slow_writes(0.01)) as (sender, receiver):
        src = make_request(3000, seed=9)
        out = LAYOUT.empty(3000)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "streamed", src)
            async with receiver.stream("streamed", chunk_tokens=512) as chunks:
                async for chunk in chunks:
                    for name, t in chunk.tensors.items():
                        out[name][chunk.start:chunk.end].copy_(t)
        assert_same(out, src)
        assert [phase for _, phase in resumes] == ["AWAITING_RESUME", "AWAITING_RESUME"]
        await wait_pools_free(sender, receiver)


async def test_a_receive_cancelled_with_a_round_announced_early_fences_both_rounds_until_the_abort_is_answered(
        resumes: list[tuple[int, str]]) -> None:
    """Round 1's blocks were announced while round 0 was written: the sender may write them as soon as round 0
    ends. A receive cancelled then fences both rounds' blocks (never freed on the receiver's word alone) until the
    sender's ABORT_ACK says no write of the room moves any more."""
    async with _pair(_slow_writes(0.3)) as (sender, receiver):
        src = make_request(3000, seed=10)
        fenced: dict[str, int] = {}
        async with anyio.create_task_group() as tg:
            async def send() -> None:
                with pytest.raises(TransferAborted):
                    await sender.send("cut", src)

            tg.start_soon(send)
            with anyio.move_on_after(5) as scope:
                async with anyio.create_task_group() as inner:
                    async def receive() -> None:
                        await receiver.receive_leased("cut")

                    inner.start_soon(receive)
                    with anyio.fail_after(5):
                        while not resumes:  # round 1 announced (early): round 0 is still being written
                            await anyio.sleep(0.005)
                    inner.cancel_scope.cancel()
                fenced = receiver.fenced_blocks
            assert not scope.cancelled_caught
        assert resumes == [(1, "WRITING")]
        assert sum(fenced.values()) == 2 * 1024 // CFG.block_size  # round 0's blocks and round 1's
        # The zero-copy claim made at TOTAL (the whole request) ended with the room, though round 0's grant
        # it is keyed to is fenced: it no longer counts against other zero-copy rooms.
        assert receiver.keeper.claimed_blocks == 0
        await wait_pools_free(sender, receiver)


@pytest.mark.parametrize(("error", "fenced"), [
    (TransportError("engine says no", may_land=False), 0),
    (RuntimeError("engine says no"), 2 * 1024 // CFG.block_size),
])
async def test_a_failed_write_with_a_round_announced_early_ends_both_rounds(
        error: Exception, fenced: int, resumes: list[tuple[int, str]]) -> None:
    """Round 0's write fails. If nothing of the room can land (a TransportError saying so), the sender's FAILED
    STATUS ends both rounds it was given, round 1's never written. If its write may still land (a foreign
    exception), both stay fenced until the sender's FENCE_RELEASE."""
    def faults(call: WriteCall) -> WriteFault:
        return WriteFault(fail_after=0.1, error=error)

    # A write that may still land is given the transport's write lifetime: long enough to see the fence.
    writer = MockTransport(faults=faults, write_lifetime=1.0)
    async with _pair(writer) as (sender, receiver):
        src = make_request(3000, seed=11)
        failed: list[BaseException] = []
        async with anyio.create_task_group() as tg:
            async def send() -> None:
                with pytest.raises(TransferFailed):
                    await sender.send("failed", src)

            tg.start_soon(send)
            try:
                await receiver.receive("failed")
            except TransferFailed as exc:
                failed.append(exc)
                held = sum(receiver.fenced_blocks.values())
        assert failed and "engine says no" in str(failed[0])
        assert resumes == [(1, "WRITING")]
        assert held == fenced
        await wait_pools_free(sender, receiver)


@pytest.mark.parametrize("failing", [0, 1])
async def test_a_round_failing_while_the_other_one_is_written_ends_the_room_only_once_both_writes_ended(
        failing: int, aheads: list[int]) -> None:
    """Round 1 is written ahead, alongside round 0. One of the two writes fails after 0.1 s (nothing of it lands); the
    other is still under way for 0.3 s. The receiver hears of the failure (and frees the blocks of both rounds)
    only once that write ended too: never while a write of the room may still reach its blocks."""
    def faults(call: WriteCall) -> WriteFault:
        if call.index == failing:
            return WriteFault(fail_after=0.1, error=TransportError("engine says no", may_land=False))
        return WriteFault(delay=0.3)

    async with _pair(MockTransport(faults=faults)) as (sender, receiver):
        src = make_request(3000, seed=14)
        t0 = anyio.current_time()
        async with anyio.create_task_group() as tg:
            async def send() -> None:
                with pytest.raises(TransferFailed, match="engine says no"):
                    await sender.send("both", src)

            tg.start_soon(send)
            with pytest.raises(TransferFailed, match="engine says no"):
                await receiver.receive("both")
            told = anyio.current_time() - t0
        assert aheads == [1]
        assert told >= 0.28, told  # the write still under way ended first
        assert sum(receiver.fenced_blocks.values()) == 0  # nothing of the failed write could land
        await wait_pools_free(sender, receiver)
        assert sender.writes_in_flight == 0


async def test_many_rooms_of_four_ranks_with_rounds_written_ahead_arrive_whole() -> None:
    """The deployment shape, in one process: 24 rooms of three rounds to four ranks at once, every write taking a
    random time (0-10 ms, seeded), so that rounds, ranks and rooms interleave every which way; every rank's rows
    are compared bit for bit. (A write watcher that outlived its round once started the round after the next
    one, whose STATUS then came before the round before it and crashed the sender: about one run in ten.)"""
    rng = random.Random(47)
    writer = MockTransport(faults=lambda call: WriteFault(delay=rng.choice([0.0, 0.0, 0.001, 0.003, 0.01])))
    cfg = TransferConfig(default_tokens=1024, max_round_tokens=1024, pool_tokens=16384)
    async with EmbeddingSender(LAYOUT, cfg, transport=writer) as sender, AsyncExitStack() as stack:
        receivers = [await stack.enter_async_context(EmbeddingReceiver(
            LAYOUT, cfg, connect=sender.address, rank=rank, world=4, transport=MockTransport())) for rank in range(4)]
        for receiver in receivers:
            await receiver.wait_connected()
        sources = {i: make_request(2500, seed=100 + i) for i in range(24)}

        async def receive(receiver: EmbeddingReceiver, i: int) -> None:
            got = await receiver.receive(f"room-{i}")
            assert got.rounds == 3
            assert_same(got.tensors, sources[i])

        async with anyio.create_task_group() as tg:
            for i, src in sources.items():
                tg.start_soon(sender.send, f"room-{i}", src)
                for receiver in receivers:
                    tg.start_soon(receive, receiver, i)
        await wait_pools_free(sender, *receivers)


async def test_a_send_cancelled_deep_in_a_room_of_600_rounds_written_ahead_ends_cleanly(
        aheads: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of one block, each announced early and written alongside the one before it: the rounds of the chain
    are siblings in one task group, not nested one per round (cancelling 500 nested scopes overflowed anyio's
    recursive delivery, and the room's final frame then went out while writes still ran). A send() cancelled
    past round 550 ends the room as for any cancel: the receiver is told once no write of the room is in flight."""
    live = [0, 0]  # write() calls running now, most at once
    real_write = SendRoomDriver.write

    async def write(self: SendRoomDriver, task: WriteTask) -> None:
        live[0] += 1
        live[1] = max(live)
        try:
            await real_write(self, task)
        finally:
            live[0] -= 1

    writing_at_end: list[bool] = []
    real_notify = SendRoomDriver.notify_end

    def notify_end(self: SendRoomDriver) -> None:
        writing_at_end.extend(self.ctx.ledger.in_flight(p.key, self.room) for p in self.rank_peer.values())
        real_notify(self)

    monkeypatch.setattr(SendRoomDriver, "write", write)
    monkeypatch.setattr(SendRoomDriver, "notify_end", notify_end)
    cfg = CFG.replace(max_round_tokens=CFG.block_size, default_tokens=CFG.block_size, pool_tokens=4096,
                      resume_reserve_tokens=0)
    free_at = 0.0

    def one_at_a_time(call: WriteCall) -> WriteFault:
        """A link that moves one write at a time, 3 ms each (longer than a control trip here): the round written
        ahead ends 3 ms after the one before it, so the next RESUME comes while it is in flight, and so on."""
        nonlocal free_at
        now = time.monotonic()
        free_at = max(now, free_at) + 0.003
        return WriteFault(delay=free_at - now)

    async with _pair(MockTransport(faults=one_at_a_time), cfg) as (sender, receiver):
        src = make_request(600 * cfg.block_size, seed=15)
        async with anyio.create_task_group() as tg:
            async def receive() -> None:
                with pytest.raises(TransferAborted, match=r"send\(\) was cancelled"):
                    await receiver.receive("deep")

            tg.start_soon(receive)
            with anyio.CancelScope() as scope:
                async def cancel_late() -> None:
                    with anyio.fail_after(60):
                        while (r := sender._rooms.get("deep")) is None or (p := r.machine.ranks.get(0)) is None \
                                or p.round < 550:
                            await anyio.sleep(0.005)
                    scope.cancel()

                tg.start_soon(cancel_late)
                await sender.send("deep", src)
            assert scope.cancelled_caught
        assert len(aheads) >= 50, len(aheads)  # many rounds went ahead (all of them, on a quiet machine)
        assert live[1] == 1  # one write() call for the whole chain: its rounds are not nested
        assert writing_at_end == [False]  # the receiver was told once no write of the room was in flight
        await wait_pools_free(sender, receiver)
        assert sender.writes_in_flight == 0


async def test_an_internal_error_in_a_round_written_ahead_fails_the_room_and_escapes_as_no_exception_group(
        monkeypatch: pytest.MonkeyPatch, aheads: list[int]) -> None:
    """A bug of ours (the room's machine refusing its driver's step) in a round written ahead, a child task: send()
    raises a TransferFailed naming it, the receiver is told, and the pools come back."""
    real = SenderRoomState.write_done

    def write_done(self: SenderRoomState, task: WriteTask, **kw: Any) -> Any:
        if task.round == 1:
            raise ProtocolError("a step refused (test)", room=self.room)
        return real(self, task, **kw)

    monkeypatch.setattr(SenderRoomState, "write_done", write_done)
    async with _pair(_slow_writes(0.02)) as (sender, receiver):
        async with anyio.create_task_group() as tg:
            async def send() -> None:
                with pytest.raises(TransferFailed, match="internal error in round 1"):
                    await sender.send("bug", make_request(3000, seed=16))

            tg.start_soon(send)
            with pytest.raises(TransferFailed, match="internal error in round 1"):
                await receiver.receive("bug")
        assert aheads[:1] == [1]  # (round 2 may have gone ahead of it too)
        await wait_pools_free(sender, receiver)


async def test_a_write_watcher_whose_round_was_announced_starts_nothing() -> None:
    """The guard behind the 24-room test, in isolation: a watcher woken after its round's STATUS went out (its
    cancellation not yet delivered) leaves the next round's early grant to the round that is now in flight."""
    async with _pair(_slow_writes(0.0)) as (sender, _):
        started: list[str] = []
        driver = SendRoomDriver("w", sender._room_ctx, anyio.current_time())  # type: ignore[arg-type]
        m = driver.machine
        m.on_init(0, blocks=(0,), allocated_tokens=128, expected_ranks=1)
        m.on_input(400)
        m.write_done(m.start_write(0))  # round 0 announced
        m.on_resume(0, round=1, sent_tokens=128, blocks=(1,), allocated_tokens=128)
        m.start_write(0)  # round 1 in flight
        m.on_resume(0, round=2, sent_tokens=256, blocks=(2,), allocated_tokens=128)  # round 2 announced early
        assert m.ahead_ranks() == [0]
        announced = anyio.Event()
        announced.set()  # the watcher's round (round 0) is over

        class Group:
            def start_soon(self, fn: Any, *args: Any) -> None:
                started.append(fn.__name__)

        with anyio.fail_after(1):
            await driver._go_ahead(0, announced, Group())  # type: ignore[arg-type]
        assert started == [] and m.ahead_ranks() == [0]


async def test_one_missed_early_reservation_does_not_end_the_head_start(
        resumes: list[tuple[int, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 1's early reservation finds the pool short (once): round 1 comes after round 0's STATUS, and round 2
    is announced early again as soon as round 1's RESUME went out."""
    real = BlockKeeper.try_reserve
    missed: list[int] = []

    def try_reserve(self: BlockKeeper, room: Any, tokens: int, **kw: Any) -> int | None:
        if kw.get("round") == 1 and not kw.get("priority") and not missed:
            missed.append(tokens)
            return None  # the pool was short for an instant
        return real(self, room, tokens, **kw)

    monkeypatch.setattr(BlockKeeper, "try_reserve", try_reserve)
    async with _pair(_slow_writes(0.02)) as (sender, receiver):
        src = make_request(3000, seed=12)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "missed", src)
            got = await receiver.receive("missed")
        assert_same(got.tensors, src)
        assert missed and resumes[0] == (1, "AWAITING_RESUME")
        # round 2's RESUME follows round 1's at once: the sender takes it early, round 1 due (READY) or under way
        assert len(resumes) == 2 and resumes[1][0] == 2 and resumes[1][1] in ("READY", "WRITING")
        await wait_pools_free(sender, receiver)


async def test_a_round_announced_early_is_timed_from_its_announcement() -> None:
    """The receiver's round time (``round_finished``) of every round: from its announcement (a round announced
    early may be written from then on, alongside the round before it) to its STATUS."""
    class Rounds(TransferObserver):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def round_finished(self, *, side: str, seconds: float) -> None:
            if side == "receiver":
                self.seconds.append(seconds)

    rounds = Rounds()
    async with _pair(_slow_writes(0.03), observer=rounds) as (sender, receiver):
        src = make_request(3000, seed=13)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "timed", src)
            await receiver.receive("timed")
        assert len(rounds.seconds) == 3
        # Each round's write takes 30 ms, written ahead or not: never less.
        assert all(s >= 0.025 for s in rounds.seconds), rounds.seconds
