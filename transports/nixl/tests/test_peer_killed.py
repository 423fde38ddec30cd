"""A peer process SIGKILLed in the middle of transfers (``aioembed.testing.processes``).

The survivor's rooms end with a typed error by their deadlines, and a receiver's pool comes back
whole once the writes of the dead sender are known to be over (its orphan lifetime: bytes its kernel
had already sent may still arrive, so the blocks they target stay fenced that long, then are freed).
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from typing import Any

import pytest
from aioembed.testing.processes import RoomSpec, SideSpec, spawn

from .conftest import NIXL_OPTIONS, NIXL_TCP_OPTIONS

pytestmark = pytest.mark.anyio

TOKENS = 20000
HIDDEN = 64
TYPED = ("PeerDead", "TransferFailed", "TransferTimeout", "TransferAborted")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def side_config(options: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return dict({"transport": "nixl", "transport_options": options, "default_tokens": 8192,
                 "max_round_tokens": 4096, "pool_tokens": 32768, "handshake_timeout": 20.0,
                 "heartbeat_interval": 0.2, "heartbeat_misses": 3, "input_timeout": 20.0}, **kw)


async def test_sender_killed_mid_transfer_receiver_fails_rooms_and_gets_its_pool_back() -> None:
    cfg = side_config(NIXL_TCP_OPTIONS)
    rooms = [RoomSpec(f"s-{i}", TOKENS) for i in range(24)]
    async with AsyncExitStack() as stack:
        sender = await stack.enter_async_context(spawn(SideSpec(
            role="send", config=cfg, rooms=rooms, hidden=HIDDEN, concurrency=4, wait_for_receivers=1)))
        address = (await sender.until("ready", timeout=60))["address"]
        receiver = await stack.enter_async_context(spawn(SideSpec(
            role="receive", config=cfg, rooms=rooms, connect=address, hidden=HIDDEN, concurrency=len(rooms),
            settle=15.0)))
        await receiver.until("ready", timeout=60)
        first = await receiver.rooms(1, timeout=60)  # transfers are under way ...
        assert first[0]["ok"], first
        sender.kill()  # ... when the sender dies
        killed_at = time.monotonic()
        rest = await receiver.rooms(len(rooms) - 1, timeout=60)
        failed = [ev for ev in rest if not ev["ok"]]
        assert failed, "the sender died with rooms in flight, yet every room succeeded"
        assert all(ev["kind"] in TYPED for ev in failed), failed[:3]
        assert all(ev["tokens"] == TOKENS for ev in rest if ev["ok"])  # completed ones were checked bit for bit
        done = await receiver.until("done", timeout=60)
        print(f"receiver: {len(failed)} rooms failed, pool whole {time.monotonic() - killed_at:.1f} s after "
              f"the kill: {done['stats']}")
        assert done["pool_free"], done  # every block free again: fenced ones released after the orphan lifetime
        assert done["stats"]["fenced"] == 0 and done["stats"]["free"] == done["stats"]["total"]


async def test_receiver_killed_mid_transfer_sender_fails_its_rooms() -> None:
    cfg = side_config(NIXL_OPTIONS, input_timeout=3.0)
    rooms = [RoomSpec(f"r-{i}", TOKENS) for i in range(16)]
    async with AsyncExitStack() as stack:
        sender = await stack.enter_async_context(spawn(SideSpec(
            role="send", config=cfg, rooms=rooms, hidden=HIDDEN, concurrency=len(rooms), wait_for_receivers=1)))
        address = (await sender.until("ready", timeout=60))["address"]
        receiver = await stack.enter_async_context(spawn(SideSpec(
            role="receive", config=cfg, rooms=rooms, connect=address, hidden=HIDDEN, concurrency=2)))
        await receiver.until("ready", timeout=60)
        await receiver.rooms(1, timeout=60)
        receiver.kill()
        start = time.monotonic()
        sent = await sender.rooms(len(rooms), timeout=60)
        elapsed = time.monotonic() - start
        failed = [ev for ev in sent if not ev["ok"]]
        assert failed, sent
        assert all(ev["kind"] in TYPED for ev in failed), failed[:3]
        assert elapsed < 30, elapsed
        done = await sender.until("done", timeout=30)
        assert done["pool_free"], done  # no room left in flight at the sender
