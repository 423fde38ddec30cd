"""A frozen receiver stalls nobody else: two receiver processes, one SIGSTOPped while rooms to it
are in flight. Rooms to the healthy one keep their normal speed; the frozen one's rooms fail by
their deadline. (Before, every batch held one of the endpoint's few worker threads until
``transfer_timeout``: writes to a frozen peer took them all and healthy peers queued behind.)"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest
from aioembed import EmbeddingSender, TransferConfig, TransferError
from aioembed.samples import checksum, deterministic_request, standard_layout
from aioembed.testing.processes import RoomSpec, SideSpec, spawn

sys.path.insert(0, str(Path(__file__).parent))
from procstate import is_stopped

pytestmark = pytest.mark.anyio

TRANSFER_TIMEOUT = 10
CONFIG: dict[str, Any] = {
    "transport": "mooncake",
    "transport_options": {"protocol": "tcp", "hostname": "127.0.0.1", "transfer_timeout": TRANSFER_TIMEOUT},
    "default_tokens": 2048, "pool_tokens": 65536, "heartbeat_interval": 0.5, "heartbeat_misses": 4,
    "input_timeout": 60.0, "round_timeout": 60.0,
}
LAYOUT = standard_layout(256)
FROZEN_ROOMS = [RoomSpec(f"f-{i}", 20000) for i in range(8)]
BASELINE = [RoomSpec(f"h-a{i}", 1500) for i in range(24)]
MEASURED = [RoomSpec(f"h-b{i}", 1500) for i in range(24)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _send(sender: EmbeddingSender, r: RoomSpec) -> None:
    data = deterministic_request(LAYOUT, r.tokens, r.room)
    await sender.send(r.room, data, {"tokens": r.tokens, "sum": checksum(data)})  # what the receiving side checks


async def _send_all(sender: EmbeddingSender, rooms: list[RoomSpec]) -> float:
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        for r in rooms:
            tg.start_soon(_send, sender, r)
    return time.monotonic() - t0


async def test_a_frozen_receiver_does_not_slow_down_rooms_to_a_healthy_one() -> None:
    config = TransferConfig.from_mapping(CONFIG)
    async with EmbeddingSender(LAYOUT, config) as sender, AsyncExitStack() as stack:
        frozen = await stack.enter_async_context(spawn(SideSpec(
            role="receive", config=CONFIG, rooms=FROZEN_ROOMS, connect=sender.address, hidden=256)))
        healthy = await stack.enter_async_context(spawn(SideSpec(
            role="receive", config=CONFIG, rooms=BASELINE + MEASURED, connect=sender.address, hidden=256,
            concurrency=32)))
        await frozen.until("ready", timeout=60)  # each process starts in its own time: never raced
        await healthy.until("ready", timeout=60)
        normal = await _send_all(sender, BASELINE)
        results = await healthy.rooms(len(BASELINE), timeout=60)
        assert all(ev["ok"] for ev in results), results

        with anyio.fail_after(30):  # the frozen receiver has asked for its rooms
            while sender.rooms_in_flight < len(FROZEN_ROOMS):
                await anyio.sleep(0.01)
        os.kill(frozen.pid, signal.SIGSTOP)
        while not is_stopped(frozen.pid):
            await anyio.sleep(0.001)
        outcomes: dict[str, BaseException | None] = {}

        async def send_frozen(r: RoomSpec) -> None:
            try:
                await _send(sender, r)
                outcomes[r.room] = None
            except TransferError as exc:
                outcomes[r.room] = exc

        t_frozen = time.monotonic()
        try:
            async with anyio.create_task_group() as tg:
                for r in FROZEN_ROOMS:  # more writes in flight to it than the endpoint has threads
                    tg.start_soon(send_frozen, r)
                with anyio.fail_after(30):
                    while sender.writes_in_flight < len(FROZEN_ROOMS):
                        await anyio.sleep(0.01)
                during = await _send_all(sender, MEASURED)
                results = await healthy.rooms(len(MEASURED), timeout=60)
            frozen_ended = time.monotonic() - t_frozen
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        assert all(ev["ok"] for ev in results), results  # bit for bit, checked by the receiving process
        # Stuck behind the frozen peer they would take at least transfer_timeout (10 s); normally well
        # under a second here. The bound sits far from both.
        assert during < min(TRANSFER_TIMEOUT / 2, max(3.0, 10 * normal)), (during, normal)
        # The frozen peer's rooms fail, by their deadline (liveness, then the write's transfer_timeout).
        assert set(outcomes) == {r.room for r in FROZEN_ROOMS}
        assert all(isinstance(e, TransferError) for e in outcomes.values()), outcomes
        assert frozen_ended < TRANSFER_TIMEOUT + 10, frozen_ended
        print(f"healthy rooms: {normal:.2f} s normally, {during:.2f} s with a frozen peer; "
              f"frozen rooms ended after {frozen_ended:.1f} s")
