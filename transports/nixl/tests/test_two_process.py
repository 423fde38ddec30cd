"""Sender and receivers in separate processes over NIXL (``aioembed.testing.processes``).

Start-up is never raced: each side prints ``ready`` only once it listens (sender) or holds a session
(receiver), and a sender that must not start early waits for its receivers (``wait_for_receivers``).
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from typing import Any

import pytest
from aioembed.testing.processes import ProcessSide, RoomSpec, SideSpec, side_logs, spawn

from .conftest import NIXL_TCP_OPTIONS

pytestmark = pytest.mark.anyio

ROOMS = 24
TOKENS = 20000
RANKS = 3
HIDDEN = 64  # bf16 values per embedding row: 156 bytes per token with token id and mrope position


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def side_config(options: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return dict({"transport": "nixl", "transport_options": options, "default_tokens": 8192,
                 "max_round_tokens": 8192, "pool_tokens": 65536, "handshake_timeout": 20.0}, **kw)


async def test_concurrent_rooms_several_ranks_two_processes_bit_for_bit() -> None:
    """20000 tokens per room into an 8192-token default reservation (three rounds, resumed), to 3 ranks
    in their own processes, 24 rooms at once; every rank checks every row bit for bit. Over UCX's TCP
    transport, the path between hosts (the shared-memory path runs in test_peer_killed.py)."""
    cfg = side_config(NIXL_TCP_OPTIONS)
    rooms = [RoomSpec(f"room-{i}", TOKENS) for i in range(ROOMS)]
    start = time.monotonic()
    async with AsyncExitStack() as stack:
        sender = await stack.enter_async_context(spawn(SideSpec(
            role="send", config=cfg, rooms=rooms, concurrency=ROOMS, linger=1.0, hidden=HIDDEN,
            wait_for_receivers=RANKS)))
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
    print(f"two-process run: {ROOMS} rooms x {RANKS} ranks x {TOKENS} tokens in {time.monotonic() - start:.1f} s")
