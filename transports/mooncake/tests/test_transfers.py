"""The completion poller: when it looks at the engine, and what it learns (a fake ``transfer_check_status``
that ends each transfer at a chosen time; one test writes through a real engine, for the keys it gives)."""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import pytest

import aioembed_mooncake._transfers as transfers
from aioembed_mooncake._transfers import (
    DONE,
    PENDING,
    SLOW,
    CompletionForecast,
    Credits,
    CreditsClosed,
    PendingTransfer,
    TransferPoller,
)

pytestmark = pytest.mark.anyio


# -- the forecast (pure) --------------------------------------------------------------------------


def test_the_forecast_knows_nothing_before_a_transfer_of_the_size_class_ended() -> None:
    f = CompletionForecast()
    assert f.expected(460_000) is None
    f.observe(460_000, ended_after=0.0004, ended_by=0.0005)
    assert f.expected(460_000) == pytest.approx(0.00045)  # a narrow interval counts by its middle
    assert f.expected(300_000) == pytest.approx(0.00045)  # the same power of two
    assert f.expected(600_000) is None  # the next one up
    assert f.expected(256) is None


def test_a_wide_interval_counts_by_its_start_so_the_forecast_errs_early() -> None:
    f = CompletionForecast()
    # The loop slept 2 ms between a poll that saw the transfer pending and the one that saw it done.
    f.observe(1 << 20, ended_after=0.0005, ended_by=0.0025)
    assert f.expected(1 << 20) == pytest.approx(0.0005)
    # An interval that ends before it starts (clock read in another order) is clamped, never negative.
    f.observe(1 << 10, ended_after=0.003, ended_by=0.001)
    assert f.expected(1 << 10) == pytest.approx(0.001)


def test_the_forecast_follows_a_change_of_speed_both_ways() -> None:
    f = CompletionForecast()
    f.observe(4096, ended_after=0.0099, ended_by=0.0100)
    for _ in range(40):  # the link got ten times faster
        f.observe(4096, ended_after=0.00099, ended_by=0.00100)
    assert f.expected(4096) == pytest.approx(0.001, rel=0.02)
    for _ in range(40):  # and slow again
        f.observe(4096, ended_after=0.0199, ended_by=0.0200)
    assert f.expected(4096) == pytest.approx(0.020, rel=0.02)


# -- the poll loop ----------------------------------------------------------------------------------


class FakeEngine:
    """``transfer_check_status`` of transfers that end at set ``time.perf_counter()`` times."""

    def __init__(self) -> None:
        self.ends: dict[int, tuple[float, int]] = {}
        self.checks: list[tuple[int, float]] = []

    def submit(self, batch: int, length: int, seconds: float, status: int = DONE,
               queue: str | None = None) -> PendingTransfer:
        self.ends[batch] = (time.perf_counter() + seconds, status)
        return PendingTransfer(batch, length, queue)

    def checked(self, batch: int) -> int:
        return sum(1 for b, _ in self.checks if b == batch)

    def check(self, batch: int) -> int:
        now = time.perf_counter()
        self.checks.append((batch, now))
        end, status = self.ends[batch]
        return status if now >= end else PENDING


class SleepLog:
    """Every ``anyio.sleep`` the poller asks for: (when, how long)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[float, float]] = []
        real = anyio.sleep

        async def sleep(seconds: float) -> None:
            self.calls.append((time.perf_counter(), seconds))
            await real(seconds)

        monkeypatch.setattr(transfers.anyio, "sleep", sleep)


async def test_the_back_off_starts_small_when_the_fresh_window_has_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop turns of the window after a submit do not grow the back-off: the first sleep after it
    is the shortest one (it used to be the longest, 2 ms, so a transfer ending just after the window
    was seen 2 ms late: 64-token requests took 3.5 ms instead of 1.7)."""
    engine, sleeps = FakeEngine(), SleepLog(monkeypatch)
    poller = TransferPoller(engine.check)
    t = engine.submit(1, 460_000, 0.030)
    poller.add([t])
    assert await poller.wait([t]) is True
    assert t.status == DONE
    assert sleeps.calls, "a 30 ms transfer with nothing learned yet is waited for with sleeps"
    delays = [d for _, d in sleeps.calls]
    doubling = [min(transfers._POLL_MAX, transfers._POLL_FIRST * 2**i) for i in range(len(delays))]
    assert delays == doubling
    assert poller.pending == 0


async def test_around_the_expected_end_the_loop_looks_on_every_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    poller = TransferPoller(engine.check)
    poller.forecast.observe(8 << 20, ended_after=0.0299, ended_by=0.0300)  # learned: about 30 ms
    expected = poller.forecast.expected(8 << 20)
    assert expected == pytest.approx(0.02995)

    sleeps = SleepLog(monkeypatch)
    t = engine.submit(9, 8 << 20, 0.030)
    poller.add([t])
    assert t.spin_from == pytest.approx(t.submitted + expected - transfers._SPIN_LEAD)
    assert t.spin_until > t.submitted + expected
    await poller.wait([t])
    assert t.status == DONE
    # Before the window it slept (no core spent on a 30 ms wait), each sleep ending by the window's start;
    # inside the window it asked for no sleep at all: it looked on every loop turn. (0.5 ms: the log
    # reads the clock a little after the poller did.)
    assert any(at < t.spin_from for at, _ in sleeps.calls), "it slept while the transfer could not have ended"
    wrong = [(at, d) for at, d in sleeps.calls if at + d > t.spin_from + 5e-4 and at < t.spin_until - 5e-4]
    assert wrong == [], (wrong, t.spin_from, t.spin_until)
    assert [at for batch, at in engine.checks if batch == 9 and at >= t.spin_from], "it looked in the window"


async def test_a_loop_turn_spent_looking_gives_up_the_core_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The threads that end a transfer (the engine's, ZeroMQ's) wait for a core the turning loop holds on a small
    host: each turn that looks again without sleeping yields first; a sleeping one does not need to."""
    yields: list[float] = []
    monkeypatch.setattr(transfers, "_sched_yield", lambda: yields.append(time.perf_counter()))
    # A window of 8 ms, not 0.3: on a busy CI host the loop was once preempted for longer than 0.3 ms between opening
    # the window and its first look, so it slept at once and never yielded (the rule under test held; the window
    # had simply passed).
    monkeypatch.setattr(transfers, "_POLL_FRESH", 0.008)
    engine, sleeps = FakeEngine(), SleepLog(monkeypatch)
    poller = TransferPoller(engine.check)
    # Nothing learned: a fresh window of turns, then sleeps. The transfer outlasts the window by far (200 ms, not
    # 20): a CI host once preempted the loop inside the window until the 20 ms transfer had ended, so it never slept.
    t = engine.submit(1, 4096, 0.200)
    poller.add([t])
    assert await poller.wait([t]) is True
    assert yields, "the turns right after the submit yielded"
    # None in the sleeps: every yield came before the first sleep. (By order, not by a time bound: on a
    # busy CI host a turn inside the window may reach its yield some milliseconds after the window ended.)
    assert sleeps.calls and max(yields) < min(at for at, _ in sleeps.calls), (yields, sleeps.calls)
    assert sleeps.calls and all(at >= t.submitted + transfers._POLL_FRESH for at, _ in sleeps.calls)


async def test_only_completed_transfers_teach_the_forecast() -> None:
    engine = FakeEngine()
    poller = TransferPoller(engine.check)
    failed = engine.submit(1, 4096, 0.001, status=-1)
    poller.add([failed])
    await poller.wait([failed])
    assert failed.status == -1
    assert poller.forecast.expected(4096) is None  # a failure says nothing about how long writes take
    ok = engine.submit(2, 4096, 0.001)
    poller.add([ok])
    await poller.wait([ok])
    assert poller.forecast.expected(4096) is not None


async def test_several_waiters_share_one_poll_loop_and_each_returns_when_its_own_transfers_end() -> None:
    engine = FakeEngine()
    poller = TransferPoller(engine.check)
    finished: dict[str, float] = {}
    quick = [engine.submit(1, 1000, 0.002), engine.submit(2, 1000, 0.002)]
    slow = [engine.submit(3, 1 << 20, 0.030)]
    poller.add(quick + slow)

    async def waiter(name: str, mine: list[PendingTransfer]) -> None:
        assert await poller.wait(mine)
        finished[name] = time.perf_counter()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, "slow", slow)
        tg.start_soon(waiter, "quick", quick)
    assert all(t.status == DONE for t in quick + slow)
    assert finished["quick"] < finished["slow"]
    assert finished["slow"] >= engine.ends[3][0]
    assert poller.pending == 0


async def test_a_deadline_leaves_the_transfer_pending_for_a_later_drain() -> None:
    engine = FakeEngine()
    poller = TransferPoller(engine.check)
    t = engine.submit(1, 4096, 0.050)
    poller.add([t])
    assert await poller.wait([t], deadline=anyio.current_time() + 0.005) is False
    assert t.status == PENDING and poller.pending == 1
    await poller.drain()
    assert t.status == DONE and poller.pending == 0


async def test_a_waiter_behind_the_leader_gives_up_at_its_own_deadline_without_a_timer_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader polls for everyone and wakes a waiter whose deadline passed (a waiter has no timer of its own:
    one per write was made, cancelled and left in the loop's heap). The leader's own transfer goes on."""
    engine = FakeEngine()
    poller = TransferPoller(engine.check)
    lead = engine.submit(1, 4096, 0.080)
    late = engine.submit(2, 4096, 3600.0)
    poller.add([lead, late])
    room_deadlines: list[float] = []
    real_scope = anyio.CancelScope

    def scope(*args: Any, **kwargs: Any) -> anyio.CancelScope:
        room_deadlines.append(kwargs.get("deadline", math.inf))
        return real_scope(*args, **kwargs)

    monkeypatch.setattr(transfers.anyio, "CancelScope", scope)
    gave_up: list[float] = []

    async def leader() -> None:
        assert await poller.wait([lead]) is True

    async def waiter(deadline: float) -> None:
        assert await poller.wait([late], deadline=deadline) is False
        gave_up.append(anyio.current_time() - deadline)

    async with anyio.create_task_group() as tg:
        tg.start_soon(leader)
        await anyio.sleep(0.001)  # the leader leads
        deadline = anyio.current_time() + 0.020
        tg.start_soon(waiter, deadline)
    assert lead.status == DONE and late.status == PENDING
    assert gave_up and 0 <= gave_up[0] < 0.015  # at its deadline, not at the end of the leader's transfer
    assert deadline not in room_deadlines  # woken by the leader's loop, whose own sleeps are cut short for it
    poller.forget([late])


async def test_watch_polls_what_a_writer_gave_up_on_while_nobody_leads() -> None:
    engine = FakeEngine()
    poller = TransferPoller(engine.check)
    t = engine.submit(1, 4096, 0.030)
    poller.add([t])
    assert await poller.wait([t], deadline=anyio.current_time()) is False  # the writer gave up at once
    with anyio.fail_after(5):
        await poller.watch(lambda: t.status != PENDING)
    assert t.status == DONE and poller.pending == 0


def without_sweeps(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch,
                   pending: list[PendingTransfer]) -> TransferPoller:
    """A poller holding ``pending`` whose polls never check everything (only a waiter's look at its deadline does)."""
    monkeypatch.setattr(transfers, "_SWEEP_EVERY", 3600.0)
    poller = TransferPoller(engine.check)
    poller.add(pending)
    poller._sweep_at = time.perf_counter() + 3600.0
    return poller


async def test_a_poll_asks_about_a_queues_transfers_oldest_first_up_to_the_first_pending(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue's transfers end about in submit order, so a poll stops at the first still pending: with 32 in
    flight every poll asked about all 32 (52 engine calls per transfer in a W3 run). Queues interleaved in
    submit order are each followed on their own."""
    engine = FakeEngine()
    head = engine.submit(1, 4096, 3600.0, queue="a")
    other = engine.submit(100, 4096, 3600.0, queue="b")
    behind = [engine.submit(b, 4096, 3600.0, queue="a") for b in range(2, 33)]
    other_behind = engine.submit(101, 4096, 3600.0, queue="b")
    unordered = engine.submit(200, 1, 3600.0)  # a release read: no queue, asked about on every poll
    poller = without_sweeps(engine, monkeypatch, [head, other, *behind[:16], other_behind, *behind[16:], unordered])
    for _ in range(5):
        poller._poll()
    assert engine.checked(1) == 5 and engine.checked(100) == 5 and engine.checked(200) == 5
    assert all(engine.checked(t.batch) == 0 for t in [*behind, other_behind])
    assert all(t.pending_at >= head.pending_at for t in behind)  # counted as seen pending with their head
    # The head ends: the same poll goes on down its peer's queue.
    engine.ends[1] = (0.0, DONE)
    engine.ends[2] = (0.0, DONE)
    moved, _, _ = poller._poll()
    assert moved and head.status == DONE and behind[0].status == DONE
    assert engine.checked(3) == 1 and engine.checked(4) == 0 and engine.checked(101) == 0
    assert poller.pending == 33


async def test_a_small_transfer_behind_a_large_one_to_the_same_peer_is_not_held_behind_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine spreads a peer's transfers over several connections, so a small one submitted after a large
    one can end first: a queue per peer alone would have seen it only at the next sweep (about 1 ms late, against
    0.1 ms)."""
    engine = FakeEngine()
    large = engine.submit(1, 16 << 20, 3600.0, queue=transfers.queue_key("peer", 16 << 20))
    small = [engine.submit(b, 460_000, 0.0005, queue=transfers.queue_key("peer", 460_000)) for b in (2, 3)]
    assert transfers.queue_key("peer", 460_000) != transfers.queue_key("peer", 16 << 20)
    assert transfers.queue_key("peer", 460_000) == transfers.queue_key("peer", 300_000)  # one size class
    poller = without_sweeps(engine, monkeypatch, [large, *small])
    with anyio.fail_after(5):
        assert await poller.wait(small) is True
    assert large.status == PENDING and all(t.status == DONE for t in small)
    poller.forget([large])


async def test_a_write_gives_each_transfer_its_peer_and_size_class_as_its_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real engine (the poll's queues are only as good as the keys the transport gives them)."""
    import torch
    from aioembed.transports.base import MemoryRegion, WriteOp

    from aioembed_mooncake import MooncakeTransport

    queues: list[object] = []
    add = TransferPoller.add

    def recording(self: TransferPoller, pending: list[PendingTransfer]) -> None:
        queues.extend(t.queue for t in pending)
        add(self, pending)

    monkeypatch.setattr(TransferPoller, "add", recording)
    small, total = 4096, 1 << 20
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dst = torch.zeros(total, dtype=torch.uint8)
    tcp = {"protocol": "tcp", "hostname": "127.0.0.1"}
    async with await MooncakeTransport.open(tcp) as a, await MooncakeTransport.open(tcp) as b:
        await a.register([MemoryRegion(src.data_ptr(), total)])
        await b.register([MemoryRegion(dst.data_ptr(), total)])
        link = await a.connect(b.descriptor())
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), small),
                          WriteOp(src.data_ptr() + small, dst.data_ptr() + small, total - small)])
        assert torch.equal(dst, src)
        session = link.session  # type: ignore[attr-defined]
        await link.aclose()
    assert queues[:2] == [transfers.queue_key(session, small), transfers.queue_key(session, total - small)]
    assert queues[0] != queues[1]


async def test_the_windows_of_transfers_behind_a_pending_head_still_say_when_to_look(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not asked about, a transfer behind its queue's pending head still counts for when to look: with the heads'
    windows only, a late head (its window passed) let the loop sleep through the windows behind it."""
    engine = FakeEngine()
    head = engine.submit(1, 4096, 3600.0, queue="a")
    behind = engine.submit(2, 4096, 3600.0, queue="a")
    poller = without_sweeps(engine, monkeypatch, [head, behind])
    now = time.perf_counter()
    head.spin_from, head.spin_until = now - 0.010, now - 0.005  # late: its window has passed
    behind.spin_from, behind.spin_until = now - 0.001, now + 3600.0  # in its window now
    moved, due, _ = poller._poll()
    assert not moved and due and engine.checked(1) == 1 and engine.checked(2) == 0
    behind.spin_from, behind.spin_until = now + 3600.0, now + 3601.0  # its window opens later
    moved, due, opens = poller._poll()
    assert not moved and not due and opens == behind.spin_from


async def test_a_transfer_that_ends_before_an_earlier_one_of_its_queue_is_seen_at_the_next_sweep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "_SWEEP_EVERY", 0.2)  # long enough to tell the sweep from the other polls
    engine = FakeEngine()
    poller = TransferPoller(engine.check)
    head = engine.submit(1, 4096, 3600.0, queue="a")  # stuck (a write that gave up on it left it behind)
    # Pending at the first poll, which is a sweep, even on a busy CI host (ending 2 ms after its submit, it was
    # seen there once the test was held that long): it ends halfway to the next sweep.
    late = engine.submit(2, 4096, 0.1, queue="a")
    poller.add([head, late])
    started = time.perf_counter()
    with anyio.fail_after(5):
        assert await poller.wait([late]) is True
    seen = time.perf_counter() - started
    assert late.status == DONE and head.status == PENDING
    assert 0.19 <= seen < 0.2 + 0.1, seen  # not before the sweep, and at it (0.1 s: a slow CI host)
    assert engine.checked(2) == 2  # at the first poll (a sweep: still pending) and at the next sweep
    poller.forget([head])


async def test_a_stuck_transfer_of_one_queue_does_not_slow_the_polls_of_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    stuck = engine.submit(1, 4096, 3600.0, queue="dead")
    ok = engine.submit(2, 4096, 0.002, queue="alive")
    poller = without_sweeps(engine, monkeypatch, [stuck, ok])
    with anyio.fail_after(5):
        assert await poller.wait([ok]) is True
    assert ok.status == DONE and stuck.status == PENDING
    poller.forget([stuck])


async def test_a_waiter_at_its_deadline_looks_at_its_own_transfers_before_giving_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its transfer ended behind a pending one of its queue, which polls skip: the deadline must not call a write
    that landed stuck (the room would be fenced for nothing)."""
    engine = FakeEngine()
    head = engine.submit(1, 4096, 3600.0, queue="a")
    mine = engine.submit(2, 4096, 0.001, queue="a")
    poller = without_sweeps(engine, monkeypatch, [head, mine])
    assert await poller.wait([mine], deadline=anyio.current_time() + 0.020) is True
    assert mine.status == DONE and engine.checked(2) == 1  # seen once: by the look at the deadline
    poller.forget([head])


class SlowEngine:
    """An RDMA engine with ``MC_SLICE_TIMEOUT`` set (no RDMA here): a transfer reports PENDING, then SLOW (a slice
    past the timeout: still in flight, id not freed) from ``slow_after``, then DONE (id freed) at ``ends_after``."""

    def __init__(self, slow_after: float, ends_after: float) -> None:
        self.slow_after, self.ends_after = slow_after, ends_after
        self.submitted: dict[int, float] = {}
        self.freed: set[int] = set()
        self.slow_seen = False

    def transfer_submit_write(self, session: str, src: int, dst: int, n: int) -> int:
        batch = len(self.submitted) + 1
        self.submitted[batch] = time.monotonic()
        return batch

    def transfer_check_status(self, batch: int) -> int:
        assert batch not in self.freed, "polled a freed id"
        age = time.monotonic() - self.submitted[batch]
        if age >= self.ends_after:
            self.freed.add(batch)
            return DONE
        if age >= self.slow_after:
            self.slow_seen = True
            return SLOW
        return PENDING


def slow_link(engine: SlowEngine, transfer_timeout: float | None = None) -> tuple[Any, Any, list[Any]]:
    """An endpoint on ``engine`` (its transfer_timeout shortened for the test), a link to a fake peer region, and
    one write op to it."""
    import ctypes

    from aioembed.transports.base import MemoryRegion, RegionSet, WriteOp

    from aioembed_mooncake._regions import Piece, PieceIndex
    from aioembed_mooncake.transport import MooncakeLink, MooncakeTransport, _Config

    t = MooncakeTransport(_Config({"protocol": "tcp", "hostname": "127.0.0.1"}), engine, "127.0.0.1:1", 1)
    if transfer_timeout is not None:
        t._transfer_timeout = transfer_timeout  # type: ignore[assignment]  # the engine's minimum is 5 s
    src = (ctypes.c_char * 4096)()
    dst = 0x10000000
    link = MooncakeLink(t, "peer:2", RegionSet([MemoryRegion(dst, 4096)]), PieceIndex([Piece(dst, dst + 4096)]))
    t._links.add(link)
    return t, link, [WriteOp(ctypes.addressof(src), dst, 4096), src]


async def test_a_transfer_the_engine_reports_slow_is_still_in_flight_and_the_write_waits_for_its_end() -> None:
    """-2 (a slice past ``MC_SLICE_TIMEOUT``) was taken as final: the write failed without ``settled`` (its blocks
    fenced only ``write_lifetime`` while the transfer could still land), its credit came back at once, and its
    engine id was never polled again, so never freed (found by a review)."""
    engine = SlowEngine(slow_after=0.02, ends_after=0.2)
    t, link, (op, _src) = slow_link(engine)
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(link.write, [op])
        await anyio.sleep(0.1)
        assert engine.slow_seen and link._credits.available == link._credits.total - 1  # in flight: credit held
    assert time.monotonic() - started >= engine.ends_after  # the write returned only once the transfer ended
    assert engine.freed == {1} and t._poller.pending == 0 and link._credits.available == link._credits.total


async def test_a_write_whose_slow_transfer_outlasts_transfer_timeout_fails_with_settled() -> None:
    from aioembed.errors import TransportError

    engine = SlowEngine(slow_after=0.02, ends_after=0.4)
    t, link, (op, _src) = slow_link(engine, transfer_timeout=0.1)
    with pytest.raises(TransportError) as err:
        await link.write([op])
    assert err.value.may_land is True and err.value.settled is not None
    assert "1 of them reported past MC_SLICE_TIMEOUT" in str(err.value)
    assert not engine.freed and link._credits.available == link._credits.total - 1  # still in flight: held
    with anyio.fail_after(5):
        await err.value.settled()
    assert time.monotonic() - engine.submitted[1] >= engine.ends_after
    assert engine.freed == {1} and t._poller.pending == 0 and link._credits.available == link._credits.total


# -- credits --------------------------------------------------------------------------------------


async def test_a_take_cancelled_on_its_fast_path_holds_nothing() -> None:
    """A cancellation at the take's checkpoint used to arrive after the credits were taken, and the caller
    never gave them back: a few cancelled writes, and the link waited for credits for ever."""
    credits = Credits(8)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await credits.take(3)
    assert credits.available == 8
    assert await credits.take(3) == 3 and credits.available == 5


async def test_a_cancelled_waiter_holds_nothing_and_the_next_one_is_served() -> None:
    credits = Credits(4)
    await credits.take(4)
    got: list[int] = []
    first, second = anyio.CancelScope(), anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_take_into, credits, 3, got, first)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(_take_into, credits, 2, got, second)
        await anyio.wait_all_tasks_blocked()
        first.cancel()
        await anyio.wait_all_tasks_blocked()
        credits.give(4)
    assert got == [2] and credits.available == 2


async def test_closing_fails_the_waiters_and_later_takes() -> None:
    credits = Credits(2)
    await credits.take(2)
    failures: list[BaseException] = []

    async def take() -> None:
        try:
            await credits.take(1)
        except CreditsClosed as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take)
        await anyio.wait_all_tasks_blocked()
        credits.close()
    assert len(failures) == 1
    with pytest.raises(CreditsClosed):
        await credits.take(1)


async def _take_into(credits: Credits, n: int, got: list[int], scope: anyio.CancelScope) -> None:
    with scope:
        got.append(await credits.take(n))
