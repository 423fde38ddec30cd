"""Abort storm: many transfers with random cancellations on both sides.

Every completed result must be bit-for-bit correct, and no write may ever land in a block that
is free at that moment (the transport is instrumented to check each op before and after it
moves bytes). CI runs a bounded storm; ``make soak`` runs the long one.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import anyio
import pytest

from aioembed import EmbeddingReceiver, TransferConfig, TransferError
from aioembed.memory.allocator import _FREE
from aioembed.transports.base import WriteOp
from aioembed.transports.loopback import LoopbackLink

from ..session.conftest import LAYOUT, assert_same, make_request, running, wait_pools_free

pytestmark = pytest.mark.anyio


class WriteGuard:
    """Wraps LoopbackLink.write: every destination row must lie in a block the receiver holds."""

    def __init__(self, receiver: EmbeddingReceiver) -> None:
        self.receiver = receiver
        self.violations: list[str] = []
        self.writes = 0
        pool = receiver.pool
        self.fields = [(t.data_ptr(), t.numel() * t.element_size(), f.row_bytes)
                       for t, f in zip(pool.tensors.values(), LAYOUT.values(), strict=True)]

    def _blocks(self, op: WriteOp) -> set[int]:
        bs = self.receiver.pool.block_size
        for base, length, row in self.fields:
            if base <= op.dst < base + length:
                first = (op.dst - base) // row
                last = (op.dst + op.length - 1 - base) // row
                return set(range(first // bs, last // bs + 1))
        self.violations.append(f"write outside the pool: {op}")
        return set()

    def check(self, ops: Sequence[WriteOp], when: str) -> None:
        state = self.receiver.allocator._state
        for op in ops:
            for b in self._blocks(op):
                if state[b] == _FREE:
                    self.violations.append(f"write {when} into free block {b}")


async def storm(transfers: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    cfg = TransferConfig(default_tokens=512, pool_tokens=8192, input_timeout=5.0, round_timeout=5.0)
    async with running(cfg) as (sender, [receiver]):
        guard = WriteGuard(receiver)
        original = LoopbackLink.write

        async def guarded(self: LoopbackLink, ops: Sequence[WriteOp]) -> None:
            guard.check(ops, "start")
            guard.writes += 1
            await original(self, ops)
            guard.check(ops, "end")

        monkeypatch.setattr(LoopbackLink, "write", guarded)
        outcomes = {"ok": 0, "receiver_cancel": 0, "sender_cancel": 0, "failed": 0}
        limiter = anyio.Semaphore(48)

        async def one(i: int) -> None:
            n = rng.choice([1, 100, 128, 300, 512, 513, 1500, 3000])
            mode = rng.random()
            delay = rng.random() * 0.004
            src = make_request(n, seed=i)
            async with limiter:
                got = None
                async with anyio.create_task_group() as tg:

                    async def send() -> None:
                        try:
                            if mode < 0.2:  # the sender gives up
                                with anyio.move_on_after(delay):
                                    await sender.send(i, src)
                            else:
                                await sender.send(i, src)
                        except TransferError:
                            pass

                    async def recv() -> None:
                        nonlocal got
                        try:
                            if 0.2 <= mode < 0.4:  # the receiver gives up
                                with anyio.move_on_after(delay):
                                    got = await receiver.receive(i)
                            else:
                                got = await receiver.receive(i)
                        except TransferError:
                            pass

                    if rng.random() < 0.5:
                        tg.start_soon(send)
                        tg.start_soon(recv)
                    else:
                        tg.start_soon(recv)
                        tg.start_soon(send)
                if got is not None:
                    assert_same(got.tensors, src)  # completed results are always exact
                    outcomes["ok"] += 1
                elif mode < 0.2:
                    outcomes["sender_cancel"] += 1
                elif mode < 0.4:
                    outcomes["receiver_cancel"] += 1
                else:
                    outcomes["failed"] += 1

        async with anyio.create_task_group() as tg:
            for i in range(transfers):
                tg.start_soon(one, i)
        # let aborts settle, then everything must be back
        with anyio.fail_after(15):
            while receiver.rooms_in_flight or sender.rooms_in_flight or receiver.allocator.stats.used:
                await anyio.sleep(0.02)
        assert guard.violations == []
        assert guard.writes > 0
        assert outcomes["ok"] > transfers // 3, outcomes
        assert outcomes["failed"] == 0, outcomes  # uncancelled transfers never fail
        await wait_pools_free(sender, receiver)


async def test_abort_storm_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    await storm(int(os.environ.get("AIOEMBED_TEST_STORM", "1000")), seed=1, monkeypatch=monkeypatch)


@pytest.mark.slow
async def test_abort_storm_long(monkeypatch: pytest.MonkeyPatch) -> None:
    await storm(20000, seed=2, monkeypatch=monkeypatch)
