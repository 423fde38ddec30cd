"""The deployment shape of encoder disaggregation, in real processes, for any cross-process transport.

Three encoder processes (senders) feed two language-model processes (receivers), each receiver
with one pool: 64 concurrent rooms, about a third of them assembled from parts sent by two or
three encoders, parts long enough to resume inside, every room checked bit for bit in the
receiving process. Then one encoder is killed mid-transfer: only its rooms and parts fail (naming
its address), the others complete, and each pool comes back whole once the dead encoder's writes
are known to be over (its transport's orphan lifetime).

A plugin runs it by subclassing (compare :class:`~aioembed.testing.TransportConformance`)::

    from aioembed.testing.many_senders import ManySendersSuite

    class TestManySenders(ManySendersSuite):
        transport_name = "mine"
        transport_options = {"protocol": "tcp"}
        backends = ("asyncio",)          # the side processes' event loops

The test process itself only orchestrates (on asyncio); the senders and receivers run on each
backend in ``backends``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from aioembed.testing.processes import ProcessSide, RoomSpec, SideSpec, spawn

__all__ = ["ManySendersSuite", "RoomPlan", "plan_rooms"]


@dataclass(frozen=True, slots=True)
class RoomPlan:
    """One room: its length, the receiver that takes it, and who sends which token range."""

    room: str
    tokens: int
    receiver: int
    pieces: tuple[tuple[int, int, int], ...]
    """``(sender index, start, end)``; one piece covering everything for a room from one sender."""

    @property
    def split(self) -> bool:
        return len(self.pieces) > 1

    def senders(self) -> set[int]:
        return {s for s, _, _ in self.pieces}


def plan_rooms(*, rooms: int, senders: int, receivers: int, seed: int, min_tokens: int, max_tokens: int,
               split_share: float = 0.35) -> list[RoomPlan]:
    """A reproducible mix: rooms spread over receivers, some split across 2..3 senders."""
    rng = random.Random(seed)
    out: list[RoomPlan] = []
    for i in range(rooms):
        tokens = rng.randint(min_tokens, max_tokens)
        if rng.random() < split_share and tokens >= 3:
            who = rng.sample(range(senders), rng.choice([2, min(3, senders)]))
            cuts = sorted(rng.sample(range(1, tokens), len(who) - 1))
            bounds = [0, *cuts, tokens]
            pieces = tuple((s, a, b) for s, a, b in zip(who, bounds, bounds[1:], strict=False))
        else:
            pieces = ((rng.randrange(senders), 0, tokens),)
        out.append(RoomPlan(f"room{i}", tokens, i % receivers, pieces))
    return out


def sender_rooms(plans: Sequence[RoomPlan], sender: int) -> list[RoomSpec]:
    """What sender ``sender`` sends: whole rooms, and its parts of split ones."""
    out: list[RoomSpec] = []
    for p in plans:
        for part, (s, start, end) in enumerate(p.pieces):
            if s == sender:
                out.append(RoomSpec(p.room, p.tokens, part=part if p.split else None, start=start, end=end))
    return out


def receiver_rooms(plans: Sequence[RoomPlan], receiver: int, addresses: Sequence[str]) -> list[RoomSpec]:
    """What receiver ``receiver`` asks for, naming each room's sender (or its parts' senders)."""
    out: list[RoomSpec] = []
    for p in plans:
        if p.receiver != receiver:
            continue
        if p.split:
            out.append(RoomSpec(p.room, p.tokens, parts=[[addresses[s], a, b] for s, a, b in p.pieces]))
        else:
            out.append(RoomSpec(p.room, p.tokens, sender=addresses[p.pieces[0][0]]))
    return out


class ManySendersSuite:
    """Subclass with ``transport_name`` (and options) to run the many-encoders scenarios."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.anyio]
    transport_name: ClassVar[str]
    transport_options: ClassVar[Mapping[str, Any]] = {}
    backends: ClassVar[tuple[str, ...]] = ("asyncio", "uvloop", "trio")
    """Event loops the side processes run on (:data:`~aioembed.testing.event_loops.EVENT_LOOPS`)."""
    rooms: ClassVar[int] = 64
    hidden: ClassVar[int] = 64
    round_tokens: ClassVar[int] = 2048
    """Default reservation and round size: parts longer than this resume inside."""
    start_timeout: ClassVar[float] = 60.0
    """Seconds a side process may take to start (a GPU host with CUDA takes 5-6 s)."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "side_backend" in metafunc.fixturenames:
            wanted = self.backends if metafunc.function.__name__.endswith("_on_each_backend") else self.backends[:1]
            metafunc.parametrize("side_backend", wanted)

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"  # the orchestration; the sides run on ``side_backend``

    def config(self) -> dict[str, Any]:
        return {
            "transport": self.transport_name, "transport_options": dict(self.transport_options),
            "default_tokens": self.round_tokens, "max_round_tokens": self.round_tokens,
            "pool_tokens": 16 * self.round_tokens, "input_timeout": 120.0, "round_timeout": 60.0,
            "handshake_timeout": 20.0,
        }

    async def _run(self, stack: AsyncExitStack, plans: Sequence[RoomPlan], backend: str, *,
                   sender_concurrency: Sequence[int] = (64, 64, 64)) -> tuple[list[ProcessSide], list[ProcessSide],
                                                                                 list[str]]:
        cfg = self.config()
        senders: list[ProcessSide] = []
        addresses: list[str] = []
        for k, concurrency in enumerate(sender_concurrency):
            side = await stack.enter_async_context(spawn(SideSpec(
                role="send", config=cfg, rooms=sender_rooms(plans, k), hidden=self.hidden, backend=backend,
                concurrency=concurrency, wait_for_receivers=2, linger=1.0)))
            senders.append(side)
        for side in senders:
            addresses.append(str((await side.ready(self.start_timeout))["address"]))
        receivers = [
            await stack.enter_async_context(spawn(SideSpec(
                role="receive", config=cfg, rooms=receiver_rooms(plans, j, addresses), hidden=self.hidden,
                backend=backend, concurrency=self.rooms, settle=15.0)))
            for j in range(2)
        ]
        for side in receivers:
            await side.ready(self.start_timeout)
        return senders, receivers, addresses

    def _plans(self, seed: int, max_tokens: int) -> list[RoomPlan]:
        plans = plan_rooms(rooms=self.rooms, senders=3, receivers=2, seed=seed, min_tokens=200,
                           max_tokens=max_tokens)
        assert sum(p.split for p in plans) >= self.rooms // 4, "the plan must split enough rooms"
        return plans

    async def test_three_encoders_two_language_processes_on_each_backend(self, side_backend: str) -> None:
        plans = self._plans(seed=18, max_tokens=4 * self.round_tokens)
        async with AsyncExitStack() as stack:
            senders, receivers, _ = await self._run(stack, plans, side_backend)
            got: dict[str, dict[str, Any]] = {}
            for j, side in enumerate(receivers):
                mine = [p for p in plans if p.receiver == j]
                for ev in await side.rooms(len(mine), timeout=240):
                    got[ev["room"]] = ev
            for k, side in enumerate(senders):
                sent = await side.rooms(len(sender_rooms(plans, k)), timeout=60)
                assert all(ev["ok"] for ev in sent), [ev for ev in sent if not ev["ok"]][:3]
            for side in receivers:
                done = await side.until("done", timeout=60)
                assert done["pool_free"], done
        bad = {room: ev for room, ev in got.items() if not ev["ok"]}
        assert not bad, list(bad.items())[:3]
        resumed_parts = 0
        for p in plans:
            longest = max(b - a for _, a, b in p.pieces)
            assert got[p.room]["rounds"] >= math.ceil(longest / self.round_tokens), (p, got[p.room])
            resumed_parts += p.split and longest > self.round_tokens
        assert resumed_parts >= 5, "the plan must resume inside parts"

    async def test_a_killed_encoder_fails_only_its_rooms_and_parts(self, side_backend: str) -> None:
        plans = self._plans(seed=1818, max_tokens=3 * self.round_tokens)
        victim = 2
        async with AsyncExitStack() as stack:
            # The victim serves two rooms at a time, so it is killed with most of its rooms in flight.
            senders, receivers, addresses = await self._run(stack, plans, side_backend,
                                                            sender_concurrency=(64, 64, 2))
            first = await senders[victim].until("room", timeout=120)
            assert first["ok"], first
            senders[victim].kill()
            address = addresses[victim]
            got: dict[str, dict[str, Any]] = {}
            for j, side in enumerate(receivers):
                mine = [p for p in plans if p.receiver == j]
                for ev in await side.rooms(len(mine), timeout=240):
                    got[ev["room"]] = ev
            for side in receivers:
                # Fenced blocks of the dead encoder come back once its orphan lifetime passed.
                done = await side.until("done", timeout=60)
                assert done["pool_free"], done
        failed_of_victim = 0
        for p in plans:
            ev = got[p.room]
            if victim not in p.senders():
                assert ev["ok"], (p, ev)  # rooms of the other encoders are untouched
            elif not ev["ok"]:
                failed_of_victim += 1
                assert address in ev["error"], (p, ev)  # the failure names the dead encoder
        assert failed_of_victim >= 5, f"the encoder was killed with only {failed_of_victim} rooms in flight"
