"""Sender and receivers in separate processes over UCX (``aioembed.testing.processes``)."""

from __future__ import annotations

import time
import warnings
from contextlib import AsyncExitStack
from typing import Any

import pytest
from aioembed.testing.processes import ProcessSide, RoomSpec, SideSpec, loop_stops, side_logs, spawn

from .conftest import UCX_OPTIONS

pytestmark = pytest.mark.anyio

ROOMS = 50
TOKENS = 20000
RANKS = 4
HIDDEN = 64  # bf16 values per embedding row: 156 bytes per token with token id and mrope position


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def side_config(**kw: Any) -> dict[str, Any]:
    return dict({"transport": "ucx", "transport_options": UCX_OPTIONS, "default_tokens": 8192,
                 "max_round_tokens": 8192, "pool_tokens": 65536, "handshake_timeout": 20.0}, **kw)


async def test_fifty_rooms_four_ranks_two_processes_bit_for_bit() -> None:
    """20000 tokens each with an 8192-token default (three rounds), 4 ranks, 50 concurrent rooms."""
    # Five processes of this test beside the other plugins' suites (make test runs them at once) on a
    # 2-core host: in some runs one receiver rank sends no PING for more than the default 5 s (heartbeat
    # 1 s x 5) while the other ranks keep pinging on time, and the sender fails its rooms. One cause was
    # found and removed (the side processes checked rows on their event loop: 0.5 s stalls idle); the
    # other is not found yet (a side whose loop stops for 3 s writes every thread's stack to its stderr,
    # reported below as a warning). This test is about data across ranks, so it tolerates 20 s of
    # silence; liveness has its own tests (test_receiver_killed_mid_transfer_fails_its_rooms, tests/faults).
    cfg = side_config(heartbeat_misses=20)
    rooms = [RoomSpec(f"room-{i}", TOKENS) for i in range(ROOMS)]
    start = time.monotonic()
    async with AsyncExitStack() as stack:
        sender = await stack.enter_async_context(
            spawn(SideSpec(role="send", config=cfg, rooms=rooms, concurrency=ROOMS, linger=1.0, hidden=HIDDEN)))
        address = (await sender.until("ready", timeout=60))["address"]
        receivers: list[ProcessSide] = []
        for rank in range(RANKS):
            spec = SideSpec(role="receive", config=cfg, rooms=rooms, connect=address, rank=rank, world=RANKS,
                            concurrency=ROOMS, hidden=HIDDEN)
            receivers.append(await stack.enter_async_context(spawn(spec)))
        for r in receivers:
            await r.until("ready", timeout=60)
        for rank, r in enumerate(receivers):
            results = await r.rooms(ROOMS, timeout=120)
            bad = [ev for ev in results if not ev["ok"]]
            assert not bad, f"rank {rank}: {bad[:3]}\n{side_logs(sender, *receivers)}"
            assert {ev["room"] for ev in results} == {s.room for s in rooms}
            assert all(ev["tokens"] == TOKENS and ev["rounds"] == 3 for ev in results)
            done = await r.until("done", timeout=30)
            assert done["pool_free"], done
        sent = await sender.rooms(ROOMS, timeout=60)
        assert all(ev["ok"] for ev in sent), [ev for ev in sent if not ev["ok"]][:3]
        if stops := loop_stops(sender, *receivers):
            warnings.warn(f"a side's event loop stopped for 3 s or more (evidence for the open silence):\n{stops}",
                          RuntimeWarning, stacklevel=1)
    print(f"two-process run: {ROOMS} rooms x {RANKS} ranks x {TOKENS} tokens in {time.monotonic() - start:.1f} s")


async def test_receiver_killed_mid_transfer_fails_its_rooms() -> None:
    """SIGKILL a receiver process while rooms are in flight: every room of the sender ends
    with a TransferError (peer dead / transport error / timeout) in bounded time."""
    cfg = side_config(heartbeat_interval=0.2, heartbeat_misses=3, input_timeout=5.0, pool_tokens=16384,
                      transport_options=dict(UCX_OPTIONS, write_timeout=2.0))
    rooms = [RoomSpec(f"k-{i}", TOKENS) for i in range(8)]
    async with AsyncExitStack() as stack:
        # The sender sends only once the receiver holds a session: a receiver process that takes 5-6 s to
        # start (torch + CUDA + ucxx on a GPU host) must not let input_timeout expire first.
        sender = await stack.enter_async_context(spawn(SideSpec(role="send", config=cfg, rooms=rooms,
                                                                hidden=HIDDEN, wait_for_receivers=1)))
        address = (await sender.until("ready", timeout=60))["address"]
        receiver = await stack.enter_async_context(spawn(SideSpec(
            role="receive", config=cfg, rooms=rooms, connect=address, hidden=HIDDEN,
            env={"AIOEMBED_TEST_START_DELAY": "6"})))  # longer than input_timeout, as seen on a GPU host
        await receiver.until("ready", timeout=60)
        await receiver.rooms(1, timeout=60)
        receiver.kill()
        start = time.monotonic()
        sent = await sender.rooms(len(rooms), timeout=60)
        assert time.monotonic() - start < 30
        failed = [ev for ev in sent if not ev["ok"]]
        assert failed, sent
        assert all(ev["kind"] in ("PeerDead", "TransferFailed", "TransferTimeout") for ev in failed), failed
