"""Shared fixtures for end-to-end tests: a layout, request generators, sender/receiver pairs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import pytest
import torch

from aioembed import EmbeddingReceiver, EmbeddingSender, Field, Layout, TransferConfig, TransferFailed
from aioembed.testing import MockTransport
from aioembed.testing.event_loops import anyio_backend_fixture
from aioembed.transports.base import MemoryRegion

LAYOUT = Layout(
    embeddings=Field((64,), torch.bfloat16),
    token_ids=Field((), torch.int32),
    mrope_positions=Field((3,), torch.int64),
)


def make_request(num_tokens: int, seed: int, layout: Layout = LAYOUT) -> dict[str, torch.Tensor]:
    """Deterministic random rows for every field (every bit pattern matters for comparison)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, f in layout.items():
        nbytes = num_tokens * f.row_bytes
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(f.dtype).reshape(num_tokens, *f.shape).clone()
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Bit-for-bit equality of every field."""
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name


async def room_goes_through(sender: EmbeddingSender, receiver: EmbeddingReceiver, room: str, num_tokens: int,
                            seed: int) -> None:
    """One room sent and received, its rows checked bit for bit: the pair still works (after a fault, say)."""
    src = make_request(num_tokens, seed)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.send, room, src)
        got = await receiver.receive(room)
    assert_same(got.tensors, src)


async def room_fails_on_both_sides(sender: EmbeddingSender, receiver: EmbeddingReceiver, room: str, match: str,
                                   *, num_tokens: int = 1500, seed: int = 3) -> None:
    """One room sent and received, both sides failing with a ``TransferFailed`` that matches ``match`` (a fault)."""
    async with anyio.create_task_group() as tg:
        async def send() -> None:
            with pytest.raises(TransferFailed, match=match):
                await sender.send(room, make_request(num_tokens, seed))

        tg.start_soon(send)
        with pytest.raises(TransferFailed, match=match):
            await receiver.receive(room)


def _pools_free(sender: EmbeddingSender, *receivers: EmbeddingReceiver) -> bool:
    regions = getattr(sender._transport, "regions", None)
    return (all(r.allocator.stats.free == r.allocator.stats.total and r.rooms_in_flight == 0 for r in receivers)
            and sender.rooms_in_flight == 0 and sender.sources_held == 0
            and (regions is None or len(regions) == _staging_regions(sender)))


async def wait_pools_free(sender: EmbeddingSender, *receivers: EmbeddingReceiver, timeout: float = 5.0) -> None:
    """After a failure, fenced blocks come back once the writer's answer (ABORT_ACK, FENCE_RELEASE,
    ...) arrives: wait for that (bounded), then check everything strictly."""
    with anyio.move_on_after(timeout):
        while not _pools_free(sender, *receivers):
            await anyio.sleep(0.005)
    assert_pools_free(sender, *receivers)


def assert_pools_free(sender: EmbeddingSender, *receivers: EmbeddingReceiver) -> None:
    """Every receive block is free and the sender holds no registration."""
    for r in receivers:
        st = r.allocator.stats
        assert st.free == st.total and st.fenced == 0 and st.waiters == 0, st
        assert r.rooms_in_flight == 0
    assert sender.rooms_in_flight == 0 and sender.sources_held == 0
    regions = getattr(sender._transport, "regions", None)
    if regions is not None:  # what stays registered: the staging area only
        assert len(regions) == _staging_regions(sender)


def _staging_regions(sender: EmbeddingSender) -> int:
    return len(sender.layout) if sender._staging is not None else 0


@asynccontextmanager
async def running(
    config: TransferConfig, *, world: int = 1, layout: Layout = LAYOUT
) -> AsyncIterator[tuple[EmbeddingSender, list[EmbeddingReceiver]]]:
    """A sender and ``world`` receivers (ranks 0..world-1), connected."""
    async with AsyncExitStack() as stack:
        sender = await stack.enter_async_context(EmbeddingSender(layout, config))
        receivers = [
            await stack.enter_async_context(
                EmbeddingReceiver(layout, config, connect=sender.address, rank=rank, world=world)
            )
            for rank in range(world)
        ]
        for r in receivers:
            await r.wait_connected()
        yield sender, receivers


anyio_backend = anyio_backend_fixture()


class CountingTransport(MockTransport):
    """A mock transport that records its register() and unregister() calls."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.registered: list[list[MemoryRegion]] = []
        self.unregistered: list[list[MemoryRegion]] = []

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        self.registered.append(list(regions))
        await super().register(regions)

    async def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        self.unregistered.append(list(regions))
        await super().unregister(regions)
