"""EmbeddingSender / EmbeddingReceiver over UCX: one process, then separate processes."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest
import torch
from aioembed import EmbeddingReceiver, EmbeddingSender, Field, Layout, TransferConfig
from aioembed.testing.source_buffers import check_registered_sources

from .conftest import UCX_OPTIONS

pytestmark = pytest.mark.anyio

LAYOUT = Layout(
    embeddings=Field((64,), torch.bfloat16),
    token_ids=Field((), torch.int32),
    mrope_positions=Field((3,), torch.int64),
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_request(num_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, f in LAYOUT.items():
        raw = torch.randint(0, 256, (num_tokens * f.row_bytes,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(f.dtype).reshape(num_tokens, *f.shape).clone()
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, b in want.items():
        a = got[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name


def config(**kw: Any) -> TransferConfig:
    return TransferConfig(transport="ucx", transport_options=UCX_OPTIONS, **kw)


async def test_three_rounds_in_one_process() -> None:
    """20000 tokens into an 8192-token default reservation, 8192 per round: three rounds."""
    cfg = config(default_tokens=8192, max_round_tokens=8192, pool_tokens=16384)
    async with EmbeddingSender(LAYOUT, cfg) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected(timeout=10)
        src = make_request(20000, seed=5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "big", src, {"tokens": 20000})
            got = await receiver.receive("big")
        assert got.num_tokens == 20000 and got.rounds == 3
        assert got.metadata == {"tokens": 20000}
        assert_same(got.tensors, src)
        st = receiver.allocator.stats
        assert st.free == st.total and receiver.rooms_in_flight == 0
        assert sender.sources_held == 0
        # CPU sources are read unregistered (reads_unregistered): no staging area, no registration per send(). Not
        # in the thread modes (test_options.py), where a source is staged: the suite runs in any of them
        # (AIOEMBED_UCX_TEST_PROGRESS).
        unregistered = UCX_OPTIONS["progress_mode"] in ("blocking", "polling")
        assert sender._transport.reads_unregistered("cpu") == unregistered  # type: ignore[union-attr]
        if unregistered:
            assert len(sender._transport.regions) == 0  # type: ignore[union-attr]


async def test_concurrent_rooms_and_ranks_in_one_process() -> None:
    cfg = config(default_tokens=1024, pool_tokens=8192)
    async with AsyncExitStack() as stack:
        sender = await stack.enter_async_context(EmbeddingSender(LAYOUT, cfg))
        receivers = [
            await stack.enter_async_context(
                EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, rank=rank, world=2))
            for rank in range(2)
        ]
        for r in receivers:
            await r.wait_connected(timeout=10)
        sizes = {i: 1 + (i * 977) % 3000 for i in range(20)}
        got: dict[tuple[int, int], Any] = {}

        async def recv(rank: int, room: int) -> None:
            got[rank, room] = await receivers[rank].receive(room)

        async with anyio.create_task_group() as tg:
            for room, n in sizes.items():
                tg.start_soon(sender.send, room, make_request(n, room), None)
                for rank in range(2):
                    tg.start_soon(recv, rank, room)
        assert len(got) == 40
        for (_rank, room), res in got.items():
            # the rest fits one round when the pool has room; with rooms sharing the pool a resume
            # round shrinks to what is free, so it may take more
            assert res.rounds == 1 if sizes[room] <= 1024 else res.rounds >= 2
            assert_same(res.tensors, make_request(sizes[room], room))


async def test_sends_from_registered_source_buffers() -> None:
    cfg = config(default_tokens=8192, pool_tokens=16384)
    async with EmbeddingSender(LAYOUT, cfg) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected(timeout=10)
        await check_registered_sources(sender, receiver, LAYOUT, tokens=16384)


async def test_a_cancelled_send_leaves_another_room_to_the_same_receiver_alone() -> None:
    """The caller of one room's send() is cancelled (its client went away) while another room to the same
    receiver is in flight on the same link: the other room succeeds (the cancelled write aborted the link's
    UCX endpoint, and with it the other room's write)."""
    layout = Layout(embeddings=Field((3584,), torch.bfloat16), token_ids=Field((), torch.int32))
    n = 4096  # 29 MB per room: both writes are in flight together
    cfg = config(default_tokens=n, pool_tokens=4 * n)

    def request(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {"embeddings": torch.randn(n, 3584, generator=g).to(torch.bfloat16),
                "token_ids": torch.randint(0, 1000, (n,), dtype=torch.int32, generator=g)}

    async with EmbeddingSender(layout, cfg) as sender, \
            EmbeddingReceiver(layout, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected(timeout=10)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "warm", request(0), None)
            await receiver.receive("warm")
        want = request(2)
        for i, delay in enumerate([0.003, 0.01, 0.03]):
            results: dict[str, Any] = {}

            async def receive(room: str, into: dict[str, Any] = results) -> None:
                try:
                    into[room] = await receiver.receive(room)
                except Exception as exc:
                    into[room] = exc

            async def send_b(room: str, into: dict[str, Any] = results) -> None:
                try:
                    await sender.send(room, want, None)
                except Exception as exc:
                    into["send " + room] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(receive, f"A{i}")
                tg.start_soon(receive, f"B{i}")
                await anyio.sleep(0.05)
                with anyio.CancelScope() as handler:  # room A's request handler
                    async with anyio.create_task_group() as inner:
                        inner.start_soon(sender.send, f"A{i}", request(1), None)
                        tg.start_soon(send_b, f"B{i}")
                        await anyio.sleep(delay)
                        handler.cancel()
            got = results[f"B{i}"]
            assert not isinstance(got, Exception), f"room B failed after A was cancelled at {delay} s: {results}"
            assert_same(got.tensors, want)
