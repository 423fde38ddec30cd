"""``register_sources()`` over a real transport, for every plugin's tests: rooms sent from slices of registered
buffers arrive bit for bit with no registration per send, also beside a send that registers its own tensors
inside the buffers' memory (overlapping registrations in the engine), and closing them leaves the
transport with the sender's staging area only."""

from __future__ import annotations

import anyio
import torch

from aioembed.layout import Layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender
from aioembed.testing.processes import deterministic_request

__all__ = ["check_registered_sources"]


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), name


async def _room(sender: EmbeddingSender, receiver: EmbeddingReceiver, room: str, rows: dict[str, torch.Tensor],
                want: dict[str, torch.Tensor]) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.send, room, rows)
        got = await receiver.receive(room)
    _same(got.tensors, want)


async def check_registered_sources(sender: EmbeddingSender, receiver: EmbeddingReceiver, layout: Layout, *,
                                   tokens: int = 20000) -> None:
    """Run the check on a connected pair whose transport exposes ``regions`` (what it holds registered).
    ``tokens`` rows per buffer; the sender needs a staging area (``staging_tokens``)."""
    regions = sender._transport.regions  # type: ignore[union-attr]
    staging_only = len(regions)
    buffers = layout.empty(tokens)
    kept = await sender.register_sources(*buffers.values())
    registered = len(regions)
    small = min(64, sender.config.staging_max_tokens)
    for i, (at, n) in enumerate([(0, small), (tokens // 20, 300), (0, tokens), (tokens // 4, tokens // 2)]):
        want = deterministic_request(layout, n, f"kept-{i}")
        rows = {}
        for name, t in want.items():
            buffers[name][at:at + n].copy_(t)
            rows[name] = buffers[name][at:at + n]
        await _room(sender, receiver, f"kept-{i}", rows, want)
        assert len(regions) == registered, "a send() from registered buffers registered something"
        if i == 1:  # one field outside the buffers: this send registers its own tensors, two inside the buffers
            mixed = dict(rows)
            first = next(iter(mixed))
            mixed[first] = mixed[first].clone()
            await _room(sender, receiver, "mixed", mixed, want)
            assert len(regions) == registered, "a send()'s own registration was not undone"
    await kept.aclose()
    assert kept.closed and sender.source_buffers == 0
    want = deterministic_request(layout, 4000, "after")
    rows = {}
    for name, t in want.items():
        buffers[name][:4000].copy_(t)
        rows[name] = buffers[name][:4000]
    await _room(sender, receiver, "after", rows, want)  # once closed: a send() registers its own tensors again
    assert sender.sources_held == 0
    assert len(regions) == staging_only, "the buffers are still registered after aclose()"
