"""BlockAllocator: accounting, misuse, FIFO waiters, cancellation, timeouts, concurrency."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import pytest
from anyio import wait_all_tasks_blocked
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aioembed import AllocationTimeout, AllocatorError, AllocatorStats, BlockAllocator

# -- construction and simple accounting -------------------------------------------------------


def _acct(s: AllocatorStats) -> tuple[int, int, int, int, int, int]:
    """The accounting fields of a stats snapshot (ignores informational counters)."""
    return (s.total, s.free, s.used, s.fenced, s.waiters, s.high_water)


def test_initial_stats() -> None:
    a = BlockAllocator(num_blocks=10, block_size=4)
    s = a.stats
    assert (s.total, s.free, s.used, s.fenced, s.waiters, s.high_water) == (10, 10, 0, 0, 0, 0)
    assert a.blocks_for(1) == 1
    assert a.blocks_for(4) == 1
    assert a.blocks_for(5) == 2
    assert a.blocks_for(40) == 10


@pytest.mark.parametrize(
    ("num_blocks", "block_size"),
    [(0, 4), (-1, 4), (4, 0), (4, -3), (1.5, 4), (4, 2.0), ("4", 4)],
)
def test_bad_construction(num_blocks: object, block_size: object) -> None:
    with pytest.raises(AllocatorError):
        BlockAllocator(num_blocks=num_blocks, block_size=block_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [0, -1, True, False, 1.0, "3", None])
def test_bad_token_counts(tokens: object) -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    before = a.stats
    with pytest.raises(AllocatorError):
        a.try_alloc(tokens)  # type: ignore[arg-type]
    assert _acct(a.stats) == _acct(before)


def test_oversize_request_raises_not_waits() -> None:
    a = BlockAllocator(num_blocks=4, block_size=8)
    assert a.try_alloc(32) is not None  # exactly the pool is fine
    b = BlockAllocator(num_blocks=4, block_size=8)
    with pytest.raises(AllocatorError, match="4 blocks"):
        b.try_alloc(33)
    assert b.stats.free == 4


@pytest.mark.anyio
async def test_async_oversize_request_raises(anyio_backend: str) -> None:
    a = BlockAllocator(num_blocks=4, block_size=8)
    held = a.try_alloc(8)
    assert held is not None
    with anyio.fail_after(5):
        with pytest.raises(AllocatorError):
            await a.alloc(33)
    assert a.stats.waiters == 0
    assert a.stats.free == 3


def test_blocks_are_distinct_ids_in_range() -> None:
    a = BlockAllocator(num_blocks=7, block_size=3)
    got = [a.try_alloc(4), a.try_alloc(3), a.try_alloc(9)]
    assert all(g is not None for g in got)
    flat = [b for g in got for b in g]  # type: ignore[union-attr]
    assert [len(g) for g in got] == [2, 1, 3]  # type: ignore[arg-type]
    assert len(set(flat)) == len(flat) == 6
    assert all(0 <= b < 7 for b in flat)
    assert a.try_alloc(4) is None  # needs 2, one left
    last = a.try_alloc(3)
    assert last is not None and set(last) == set(range(7)) - set(flat)


def test_misuse_refused_atomically() -> None:
    a = BlockAllocator(num_blocks=6, block_size=1)
    x = a.try_alloc(3)
    assert x is not None
    before = a.stats
    free_id = next(b for b in range(6) if b not in x)
    bad_calls = [
        lambda: a.free([x[0], x[0]]),  # duplicate in one call
        lambda: a.free([x[0], free_id]),  # one good, one free: nothing freed
        lambda: a.free([x[0], 6]),
        lambda: a.free([x[0], -1]),
        lambda: a.free([True]),
        lambda: a.free(["0"]),  # type: ignore[list-item]
        lambda: a.free([1.0]),  # type: ignore[list-item]
        lambda: a.fence([free_id]),
        lambda: a.fence([x[1], x[1]]),
        lambda: a.fence([x[1], 99]),
    ]
    for call in bad_calls:
        with pytest.raises(AllocatorError):
            call()
        assert _acct(a.stats) == _acct(before)
    a.fence([x[2]])
    with pytest.raises(AllocatorError, match="fenced"):
        a.fence([x[2]])
    assert a.stats.fenced == 1
    a.free(x)
    assert a.stats.free == 6 and a.stats.fenced == 0
    with pytest.raises(AllocatorError, match="already free"):
        a.free([x[0]])


def test_free_accepts_any_iterable_and_empty() -> None:
    a = BlockAllocator(num_blocks=5, block_size=1)
    x = a.try_alloc(5)
    assert x is not None
    a.free([])
    assert a.stats.used == 5
    a.free(iter(x[:2]))
    a.free(tuple(x[2:4]))
    a.free(b for b in x[4:])
    assert a.stats.free == 5


# -- stateful model ---------------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Any interleaving of try_alloc / free / fence keeps the accounting exact."""

    def __init__(self) -> None:
        super().__init__()
        self.a: BlockAllocator
        self.total = 0
        self.bs = 1
        self.allocs: list[list[int]] = []  # outstanding allocations (block lists)
        self.fenced: set[int] = set()
        self.high_water = 0

    @initialize(total=st.integers(1, 24), bs=st.integers(1, 5))
    def setup(self, total: int, bs: int) -> None:
        self.a = BlockAllocator(num_blocks=total, block_size=bs)
        self.total, self.bs = total, bs

    @property
    def used(self) -> set[int]:
        return {b for al in self.allocs for b in al}

    def _expect_refused(self, call) -> None:  # type: ignore[no-untyped-def]
        before = self.a.stats
        try:
            call()
        except AllocatorError:
            pass
        else:
            raise AssertionError("misuse was accepted")
        assert _acct(self.a.stats) == _acct(before)

    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        tokens = data.draw(st.integers(1, (self.total + 2) * self.bs), label="tokens")
        need = -(-tokens // self.bs)
        if need > self.total:
            self._expect_refused(lambda: self.a.try_alloc(tokens))
            return
        free_before = self.total - len(self.used)
        got = self.a.try_alloc(tokens)
        if need > free_before:
            assert got is None
            return
        assert got is not None
        assert len(got) == need
        assert len(set(got)) == need
        assert all(isinstance(b, int) and 0 <= b < self.total for b in got)
        assert not set(got) & self.used, "a block was handed out twice"
        self.allocs.append(list(got))
        self.high_water = max(self.high_water, len(self.used))

    @precondition(lambda self: self.allocs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.allocs) - 1), label="alloc")
        blocks = self.allocs[i]
        part = data.draw(st.lists(st.sampled_from(blocks), min_size=1, unique=True), label="part")
        part = data.draw(st.permutations(part), label="order")
        self.a.free(part)
        rest = [b for b in blocks if b not in part]
        if rest:
            self.allocs[i] = rest
        else:
            del self.allocs[i]
        self.fenced -= set(part)

    @precondition(lambda self: self.allocs)
    @rule(data=st.data())
    def fence(self, data: st.DataObject) -> None:
        candidates = sorted(self.used - self.fenced)
        if not candidates:
            self._expect_refused(lambda: self.a.fence([sorted(self.fenced)[0]]))
            return
        part = data.draw(st.lists(st.sampled_from(candidates), min_size=1, unique=True), label="fence")
        self.a.fence(part)
        self.fenced |= set(part)

    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        free_ids = sorted(set(range(self.total)) - self.used)
        if not free_ids:
            return
        bad = data.draw(st.sampled_from(free_ids), label="free id")
        good = sorted(self.used)[:2]
        ids = data.draw(st.permutations([*good, bad]), label="ids")
        self._expect_refused(lambda: self.a.free(ids))

    @precondition(lambda self: self.allocs)
    @rule(data=st.data())
    def free_duplicate_in_one_call(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(sorted(self.used)), label="dup")
        self._expect_refused(lambda: self.a.free([b, b]))

    @rule(bad=st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=24),
        st.booleans(),
        st.floats(allow_nan=False),
        st.text(max_size=2),
        st.none(),
    ))
    def foreign_ids(self, bad: object) -> None:
        if isinstance(bad, int) and not isinstance(bad, bool) and 0 <= bad < self.total:
            return
        ids = [*sorted(self.used)[:1], bad]
        self._expect_refused(lambda: self.a.free(ids))
        self._expect_refused(lambda: self.a.fence(ids))

    @rule(data=st.data())
    def fence_free_block(self, data: st.DataObject) -> None:
        free_ids = sorted(set(range(self.total)) - self.used)
        if free_ids:
            b = data.draw(st.sampled_from(free_ids), label="free id")
            self._expect_refused(lambda: self.a.fence([b]))

    @rule(data=st.data())
    def check_exact_free_set(self, data: st.DataObject) -> None:
        """Taking every free block returns exactly the complement of what is outstanding."""
        free_n = self.total - len(self.used)
        if free_n == 0 or not data.draw(st.booleans(), label="drain"):
            return
        got = self.a.try_alloc(free_n * self.bs)
        assert got is not None
        assert set(got) == set(range(self.total)) - self.used
        self.high_water = self.total
        self.a.free(got)

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "a"):
            return
        s = self.a.stats
        used = len(self.used)
        assert s.total == self.total
        assert s.free + s.used == s.total
        assert s.used == used
        assert s.fenced == len(self.fenced)
        assert s.waiters == 0
        assert s.high_water == self.high_water

    def teardown(self) -> None:
        if not hasattr(self, "a"):
            return
        for al in self.allocs:
            self.a.free(al)
        s = self.a.stats
        assert s.free == self.total and s.used == 0 and s.fenced == 0


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAllocatorMachine = AllocatorMachine.TestCase


# -- waiting: FIFO, cancellation, timeouts ----------------------------------------------------


@pytest.mark.anyio
async def test_fifo_big_waiter_not_overtaken(anyio_backend: str) -> None:
    a = BlockAllocator(num_blocks=4, block_size=1)
    held = a.try_alloc(3)
    assert held is not None
    grants: list[tuple[str, list[int]]] = []

    async def want(name: str, n: int) -> None:
        blocks = await a.alloc(n)
        grants.append((name, blocks))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(want, "big", 4)
            await wait_all_tasks_blocked()
            assert a.stats.waiters == 1
            tg.start_soon(want, "small1", 1)
            await wait_all_tasks_blocked()
            tg.start_soon(want, "small2", 1)
            await wait_all_tasks_blocked()
            # one block is free, but the big waiter is first in line
            assert a.stats.free == 1
            assert a.stats.waiters == 3
            assert grants == []
            assert a.try_alloc(1) is None, "try_alloc overtook waiting coroutines"
            a.free(held)
            await wait_all_tasks_blocked()
            assert [g[0] for g in grants] == ["big"]
            assert sorted(grants[0][1]) == [0, 1, 2, 3]
            assert a.stats.waiters == 2
            big_blocks = grants[0][1]
            a.free(big_blocks[:1])
            await wait_all_tasks_blocked()
            assert [g[0] for g in grants] == ["big", "small1"]
            assert a.stats.waiters == 1
            a.free(big_blocks[1:2])
            await wait_all_tasks_blocked()
            assert [g[0] for g in grants] == ["big", "small1", "small2"]
            assert a.stats.waiters == 0
    assert a.stats.used == 4
    assert {b for _, bl in grants[1:] for b in bl} == set(big_blocks[:2])
    a.free(big_blocks[2:] + grants[1][1] + grants[2][1])
    assert a.stats.free == 4


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_waiters_served_in_request_order(anyio_backend: str, seed: int) -> None:
    """Blocks come back one at a time; after each free the granted waiters are exactly the
    longest prefix of the queue that fits, in request order."""
    rng = random.Random(seed)
    a = BlockAllocator(num_blocks=8, block_size=2)
    held = a.try_alloc(16)
    assert held is not None
    sizes = [rng.randint(1, 16) for _ in range(8)]
    results: dict[int, list[int]] = {}

    async def want(i: int, tokens: int) -> None:
        results[i] = await a.alloc(tokens)

    owned = list(held)
    handed_back: set[int] = set()
    free_model = 0
    next_up = 0
    async with anyio.create_task_group() as tg:
        for i, n in enumerate(sizes):
            tg.start_soon(want, i, n)
            await wait_all_tasks_blocked()
        assert a.stats.waiters == len(sizes)
        assert a.try_alloc(1) is None
        while next_up < len(sizes) or owned:
            if not owned:
                raise AssertionError(f"deadlock in the model at waiter {next_up}")
            b = owned.pop(rng.randrange(len(owned)))
            a.free([b])
            free_model += 1
            await wait_all_tasks_blocked()
            while next_up < len(sizes) and a.blocks_for(sizes[next_up]) <= free_model:
                free_model -= a.blocks_for(sizes[next_up])
                next_up += 1
            assert set(results) == set(range(next_up)), "grants are not a FIFO prefix"
            assert a.stats.waiters == len(sizes) - next_up
            assert a.stats.free == free_model
            for i in range(next_up):
                if i not in handed_back:
                    assert len(results[i]) == a.blocks_for(sizes[i])
                    owned.extend(results[i])  # handed back block by block
                    handed_back.add(i)
    assert a.stats.free == 8 and a.stats.waiters == 0


@pytest.mark.anyio
async def test_cancel_waiter_before_grant(anyio_backend: str) -> None:
    a = BlockAllocator(num_blocks=4, block_size=1)
    held = a.try_alloc(2)
    assert held is not None
    got: list[list[int]] = []

    async def small() -> None:
        got.append(await a.alloc(1))

    big_scope = anyio.CancelScope()

    async def big() -> None:
        with big_scope:
            await a.alloc(4)
            raise AssertionError("cancelled waiter got blocks")

    async with anyio.create_task_group() as tg:
        tg.start_soon(big)
        await wait_all_tasks_blocked()
        tg.start_soon(small)
        await wait_all_tasks_blocked()
        assert a.stats.waiters == 2
        assert got == []
        big_scope.cancel()
        await wait_all_tasks_blocked()
    # the small waiter behind the cancelled head was served from the 2 free blocks
    assert len(got) == 1
    assert a.stats.waiters == 0
    assert a.stats.used == 3
    a.free(got[0])
    a.free(held)
    assert a.stats.free == 4 and a.stats.used == 0


@pytest.mark.anyio
async def test_cancel_waiter_after_grant_returns_blocks(anyio_backend: str) -> None:
    """Cancellation is on its way when the blocks are granted: they go back, nothing leaks."""
    a = BlockAllocator(num_blocks=4, block_size=1)
    held = a.try_alloc(4)
    assert held is not None
    received: list[list[int]] = []
    scope = anyio.CancelScope()

    async def waiter() -> None:
        with scope:
            received.append(await a.alloc(3))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await wait_all_tasks_blocked()
        assert a.stats.waiters == 1
        scope.cancel()  # cancellation delivered to the waiting coroutine ...
        a.free(held)  # ... which is still queued, so it is granted before it runs again
        assert a.stats.waiters == 0
        assert a.stats.used == 3
    assert received == []
    assert scope.cancelled_caught
    assert a.stats.free == 4 and a.stats.used == 0
    again = a.try_alloc(4)
    assert again is not None and sorted(again) == [0, 1, 2, 3]


@pytest.mark.anyio
async def test_cancel_after_grant_delivered(anyio_backend: str) -> None:
    """Granted first, cancelled after: the caller either owns the blocks or they went back."""
    a = BlockAllocator(num_blocks=4, block_size=1)
    held = a.try_alloc(4)
    assert held is not None
    received: list[list[int]] = []
    scope = anyio.CancelScope()

    async def waiter() -> None:
        with scope:
            received.append(await a.alloc(3))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await wait_all_tasks_blocked()
        a.free(held)
        scope.cancel()
    if received:
        assert len(received[0]) == 3 and a.stats.used == 3
        a.free(received[0])
    assert a.stats.free == 4 and a.stats.used == 0


@pytest.mark.anyio
async def test_cancel_granted_waiter_serves_next(anyio_backend: str) -> None:
    """Blocks given back by a cancelled, already granted waiter go to the next one in line."""
    a = BlockAllocator(num_blocks=4, block_size=1)
    held = a.try_alloc(4)
    assert held is not None
    scope = anyio.CancelScope()
    first: list[list[int]] = []
    second: list[list[int]] = []

    async def w1() -> None:
        with scope:
            first.append(await a.alloc(4))

    async def w2() -> None:
        second.append(await a.alloc(4))

    async with anyio.create_task_group() as tg:
        tg.start_soon(w1)
        await wait_all_tasks_blocked()
        tg.start_soon(w2)
        await wait_all_tasks_blocked()
        scope.cancel()
        a.free(held)  # granted to w1, whose cancellation is pending: w1 must pass them on to w2
        await wait_all_tasks_blocked()
    assert first == []
    assert len(second) == 1 and sorted(second[0]) == [0, 1, 2, 3]
    a.free(second[0])
    assert a.stats.free == 4 and a.stats.waiters == 0


@pytest.mark.anyio
async def test_timeout_raises_allocation_timeout(anyio_backend: str) -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    held = a.try_alloc(4)
    assert held is not None
    before = a.stats
    with anyio.fail_after(10):
        with pytest.raises(AllocationTimeout) as info:
            await a.alloc(6, timeout=0.05)
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, AllocatorError)
    assert _acct(a.stats) == _acct(before)
    assert a.stats.waiters == 0


@pytest.mark.anyio
async def test_timed_out_head_lets_next_waiter_through(anyio_backend: str) -> None:
    a = BlockAllocator(num_blocks=4, block_size=1)
    held = a.try_alloc(3)
    assert held is not None
    outcome: dict[str, object] = {}

    async def big() -> None:
        try:
            await a.alloc(4, timeout=0.05)
        except AllocationTimeout as exc:
            outcome["big"] = exc

    async def small() -> None:
        outcome["small"] = await a.alloc(1)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(big)
            await wait_all_tasks_blocked()
            tg.start_soon(small)
            await wait_all_tasks_blocked()
            assert a.stats.waiters == 2
            assert "small" not in outcome
    assert isinstance(outcome["big"], AllocationTimeout)
    small_blocks = outcome["small"]
    assert isinstance(small_blocks, list) and len(small_blocks) == 1
    a.free(small_blocks)
    a.free(held)
    assert a.stats.free == 4 and a.stats.waiters == 0


@pytest.mark.anyio
async def test_alloc_without_wait_and_timeout(anyio_backend: str) -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    got = await a.alloc(7, timeout=0.01)
    assert len(got) == 4
    a.free(got)
    assert a.stats.free == 4


@pytest.mark.anyio
async def test_stats_waiters_counts(anyio_backend: str) -> None:
    a = BlockAllocator(num_blocks=2, block_size=1)
    held = a.try_alloc(2)
    assert held is not None
    done: list[list[int]] = []

    async def w() -> None:
        done.append(await a.alloc(1))

    async with anyio.create_task_group() as tg:
        for expected in range(1, 6):
            tg.start_soon(w)
            await wait_all_tasks_blocked()
            assert a.stats.waiters == expected
            assert a.stats.waited == expected
        a.free(held)
        assert a.stats.waiters == 3
        await wait_all_tasks_blocked()
        a.free(done[0] + done[1])
        assert a.stats.waiters == 1
        await wait_all_tasks_blocked()
        a.free(done[2])
        assert a.stats.waiters == 0
    a.free(done[3] + done[4])
    assert a.stats.free == 2
    assert a.stats.waited == 5
    got = await a.alloc(2)  # served at once: not counted as a wait
    assert a.stats.waited == 5
    a.free(got)


@pytest.mark.anyio
async def test_cancelled_immediate_alloc_does_not_leak(anyio_backend: str) -> None:
    a = BlockAllocator(num_blocks=4, block_size=1)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await a.alloc(2)
        raise AssertionError("alloc in a cancelled scope returned")
    assert scope.cancelled_caught
    assert a.stats.used == 0, f"{a.stats.used} blocks leaked by a cancelled alloc()"


# -- concurrency stress -----------------------------------------------------------------------


@dataclass
class _Model:
    """The test's own FIFO model of the allocator, updated synchronously with it."""

    free: int
    waiting: deque[tuple[int, int]] = field(default_factory=deque)  # (request seq, blocks)
    granted: set[int] = field(default_factory=set)  # request seqs granted but not yet resumed

    def serve(self) -> None:
        while self.waiting and self.waiting[0][1] <= self.free:
            seq, n = self.waiting.popleft()
            self.free -= n
            self.granted.add(seq)


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [1, 2])
async def test_concurrent_stress(anyio_backend: str, seed: int) -> None:
    rng = random.Random(seed)
    num_blocks, bs = 16, 4
    a = BlockAllocator(num_blocks=num_blocks, block_size=bs)
    model = _Model(free=num_blocks)
    owner: dict[int, int] = {}
    seq_counter = 0
    grants = 0
    waited = 0
    max_seen_used = 0

    async def worker(tid: int) -> None:
        nonlocal seq_counter, grants, waited, max_seen_used
        for _cycle in range(4):
            tokens = rng.randint(1, num_blocks * bs)
            need = a.blocks_for(tokens)
            seq = seq_counter
            seq_counter += 1
            # alloc() decides synchronously whether to wait: mirror that in the model
            will_wait = bool(model.waiting) or need > model.free
            if will_wait:
                model.waiting.append((seq, need))
                waited += 1
            else:
                model.free -= need
            blocks = await a.alloc(tokens)
            if will_wait:
                assert seq in model.granted, f"request {seq} was granted out of FIFO order"
                model.granted.discard(seq)
            assert len(blocks) == need
            for b in blocks:
                assert b not in owner, f"block {b} owned by {owner.get(b)} and {tid}"
                owner[b] = tid
            grants += 1
            max_seen_used = max(max_seen_used, a.stats.used)
            for _ in range(rng.randint(0, 3)):
                await anyio.lowlevel.checkpoint()
                assert all(owner[b] == tid for b in blocks)
            for b in blocks:
                del owner[b]
            rng.shuffle(blocks)
            a.free(blocks)
            model.free += need
            model.serve()
            assert a.stats.free == model.free
            assert a.stats.waiters == len(model.waiting)
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for tid in range(200):
                tg.start_soon(worker, tid)
    assert grants == 800
    assert waited > 50, "the stress test did not make coroutines wait"
    assert owner == {}
    assert model.granted == set() and not model.waiting
    s = a.stats
    assert (s.free, s.used, s.fenced, s.waiters) == (num_blocks, 0, 0, 0)
    assert s.high_water >= max_seen_used
    assert s.high_water <= num_blocks


def test_free_one_block_from_huge_pool() -> None:
    """``free`` is O(blocks freed): freeing single blocks of a 1M-block pool works promptly."""
    n = 1_000_000
    a = BlockAllocator(num_blocks=n, block_size=1)
    got = a.try_alloc(n - 1)
    assert got is not None and len(got) == n - 1
    assert a.stats.free == 1
    for b in got[:200]:
        a.free([b])
    assert a.stats.free == 201
    one = a.try_alloc(1)
    assert one is not None
    a.free(one)
    a.free(got[200:])
    assert a.stats.free == n and a.stats.used == 0
