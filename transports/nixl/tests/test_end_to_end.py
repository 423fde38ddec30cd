"""EmbeddingSender / EmbeddingReceiver over NIXL in one process, under asyncio and trio.

(Separate processes: test_two_process.py and test_peer_killed.py.)
"""

from __future__ import annotations

import anyio
import pytest
import torch
from aioembed import EmbeddingReceiver, EmbeddingSender, Field, Layout, TransferConfig
from aioembed.testing.event_loops import anyio_backend_fixture
from aioembed.testing.source_buffers import check_registered_sources

from .conftest import NIXL_OPTIONS

pytestmark = pytest.mark.anyio

LAYOUT = Layout(
    embeddings=Field((64,), torch.bfloat16),
    token_ids=Field((), torch.int32),
    mrope_positions=Field((3,), torch.int64),
)


anyio_backend = anyio_backend_fixture()


def make_request(num_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, f in LAYOUT.items():
        raw = torch.randint(0, 256, (num_tokens * f.row_bytes,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(f.dtype).reshape(num_tokens, *f.shape).clone()
    return out


async def test_three_rounds_and_concurrent_rooms_in_one_process() -> None:
    """20000 tokens into an 8192-token default reservation (three rounds), beside small rooms."""
    cfg = TransferConfig(transport="nixl", transport_options=NIXL_OPTIONS, default_tokens=8192,
                         max_round_tokens=8192, pool_tokens=16384)
    async with EmbeddingSender(LAYOUT, cfg) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected(timeout=10)
        sizes = {"big": 20000, **{f"small-{i}": 1 + 97 * i for i in range(8)}}
        got = {}

        async def recv(room: str) -> None:
            got[room] = await receiver.receive(room)

        async with anyio.create_task_group() as tg:
            for room, n in sizes.items():
                tg.start_soon(sender.send, room, make_request(n, len(room) * n), {"tokens": n})
                tg.start_soon(recv, room)
        assert got["big"].num_tokens == 20000 and got["big"].rounds >= 3
        for room, n in sizes.items():
            want = make_request(n, len(room) * n)
            if got[room].rounds == 1:  # a resumed room's metadata is checked across processes (processes.py)
                assert got[room].metadata == {"tokens": n}
            for name, t in want.items():
                assert torch.equal(got[room].tensors[name].view(torch.uint8), t.view(torch.uint8)), (room, name)
        st = receiver.allocator.stats
        assert st.free == st.total and receiver.rooms_in_flight == 0
        assert sender.sources_held == 0  # per-send registrations undone
        assert len(sender._transport.regions) == len(LAYOUT)  # type: ignore[union-attr]  # the staging area only


async def test_sends_from_registered_source_buffers() -> None:
    cfg = TransferConfig(transport="nixl", transport_options=NIXL_OPTIONS, default_tokens=8192, pool_tokens=16384)
    async with EmbeddingSender(LAYOUT, cfg) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected(timeout=10)
        await check_registered_sources(sender, receiver, LAYOUT, tokens=16384)
