"""EmbeddingSender -> EmbeddingReceiver over mooncake TCP: in one process, then in separate processes."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import pytest
import torch
from aioembed import EmbeddingReceiver, EmbeddingSender, Layout, TransferConfig
from aioembed.testing.processes import RoomSpec, SideSpec, deterministic_request, spawn, standard_layout
from aioembed.testing.source_buffers import check_registered_sources

pytestmark = pytest.mark.anyio

TOKENS, DEFAULT = 20000, 8192
ROUNDS = math.ceil(TOKENS / DEFAULT)  # 3: 8192 + 8192 + 3616
OPTIONS = {"protocol": "tcp", "hostname": "127.0.0.1"}
LAYOUT = standard_layout(64)


def config(**kw: object) -> TransferConfig:
    base: dict[str, object] = dict(
        transport="mooncake", transport_options=OPTIONS, default_tokens=DEFAULT,
        max_round_tokens=DEFAULT,  # every round reserves at most the default: three rounds for 20000
        pool_tokens=65536,
    )
    base.update(kw)
    return TransferConfig(**base)  # type: ignore[arg-type]


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), name


@asynccontextmanager
async def running(cfg: TransferConfig, world: int = 1,
                  layout: Layout = LAYOUT) -> AsyncIterator[tuple[EmbeddingSender, list[EmbeddingReceiver]]]:
    async with AsyncExitStack() as stack:
        sender = await stack.enter_async_context(EmbeddingSender(layout, cfg))
        receivers = [
            await stack.enter_async_context(EmbeddingReceiver(layout, cfg, connect=sender.address, rank=r, world=world))
            for r in range(world)
        ]
        for r in receivers:
            await r.wait_connected()
        yield sender, receivers


async def test_one_process_three_rounds_bit_for_bit() -> None:
    async with running(config()) as (sender, [receiver]):
        src = deterministic_request(LAYOUT, TOKENS, "room-1")
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "room-1", src, {"n": TOKENS})
            got = await receiver.receive("room-1")
        assert got.num_tokens == TOKENS and got.rounds == ROUNDS and got.metadata == {"n": TOKENS}
        assert_same(got.tensors, src)
        st = receiver.allocator.stats
        assert st.free == st.total
        assert sender.sources_held == 0
        # CPU sources are read unregistered (reads_unregistered): no staging area, no registration per send().
        assert sender._transport.reads_unregistered("cpu")  # type: ignore[union-attr]
        assert len(sender._transport.regions) == 0  # type: ignore[union-attr]


async def test_one_process_four_ranks_concurrent_rooms() -> None:
    rooms = 12
    async with running(config(), world=4) as (sender, receivers):
        got: dict[tuple[int, int], object] = {}

        async def recv(rank: int, room: int) -> None:
            got[rank, room] = await receivers[rank].receive(room)

        srcs = {room: deterministic_request(LAYOUT, TOKENS if room % 3 == 0 else 3000 + room, room)
                for room in range(rooms)}
        async with anyio.create_task_group() as tg:
            for room, src in srcs.items():
                for rank in range(4):
                    tg.start_soon(recv, rank, room)
                tg.start_soon(sender.send, room, src)
        for (_rank, room), res in got.items():
            assert_same(res.tensors, srcs[room])  # type: ignore[attr-defined]
        for r in receivers:
            assert r.allocator.stats.free == r.allocator.stats.total


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_two_processes_four_ranks_fifty_rooms() -> None:
    """The deployment shape: a sender process and four receiver processes (ranks 0..3), 50 rooms
    of 20000 tokens with an 8192-token default, all concurrent; every rank checks every room bit
    for bit against rows regenerated from the room id."""
    rooms = [RoomSpec(room=i, tokens=TOKENS) for i in range(50)]
    cfg = {
        "transport": "mooncake", "transport_options": OPTIONS, "default_tokens": DEFAULT,
        "max_round_tokens": DEFAULT, "pool_tokens": 65536, "input_timeout": 120.0,
    }
    send_spec = SideSpec(role="send", config=cfg, rooms=rooms, hidden=64, concurrency=50)
    async with spawn(send_spec) as sender:
        ready = await sender.until("ready", timeout=60)
        async with AsyncExitStack() as stack:
            receivers = [
                await stack.enter_async_context(spawn(SideSpec(
                    role="receive", config=cfg, rooms=rooms, hidden=64, connect=ready["address"],
                    rank=rank, world=4, concurrency=50)))
                for rank in range(4)
            ]
            results = {}
            for rank, side in enumerate(receivers):
                results[rank] = await side.rooms(len(rooms), timeout=150)
            sent = await sender.rooms(len(rooms), timeout=60)
            for side in receivers:
                done = await side.until("done", timeout=30)
                assert done["pool_free"], done
        assert all(ev["ok"] for ev in sent), [ev for ev in sent if not ev["ok"]][:3]
        for rank, evs in results.items():
            bad = [ev for ev in evs if not ev["ok"] or ev["rounds"] < ROUNDS or ev["tokens"] != TOKENS]
            assert not bad, (rank, bad[:3])
            assert sorted(ev["room"] for ev in evs) == list(range(50))



async def test_sends_from_registered_source_buffers_over_the_engine() -> None:
    async with running(config()) as (sender, [receiver]):
        await check_registered_sources(sender, receiver, LAYOUT, tokens=TOKENS)
