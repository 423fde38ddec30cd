"""``register_sources()`` over a real transport, for every plugin's tests: rooms sent from slices of registered
buffers arrive bit for bit with no registration per send, also beside a send of tensors inside the buffers' memory
that are not all in them (which registers its own tensors, overlapping the buffers' registration in the engine, or,
on a transport that reads unregistered sources, registers nothing), and closing them leaves the transport with
what it held before (the sender's staging area, if it has one)."""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import torch

from aioembed.layout import Layout
from aioembed.samples import same_rows
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender
from aioembed.testing.processes import deterministic_request

__all__ = ["check_registered_sources", "rows_in", "send_and_check"]


def rows_in(buffers: Mapping[str, torch.Tensor], at: int, rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``rows`` written into ``buffers`` from row ``at``: the slices of the buffers a ``send()`` is given."""
    n = next(iter(rows.values())).shape[0]
    out = {}
    for name, t in rows.items():
        buffers[name][at:at + n].copy_(t)
        out[name] = buffers[name][at:at + n]
    return out


async def send_and_check(sender: EmbeddingSender, receiver: EmbeddingReceiver, room: str,
                         rows: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """Send ``rows`` as ``room`` and receive it; the rows that arrived are ``want``, bit for bit."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.send, room, rows)
        got = await receiver.receive(room)
    assert same_rows({n: t.cpu() for n, t in got.tensors.items()}, {n: t.cpu() for n, t in want.items()}), \
        f"room {room!r}: the rows differ"


async def check_registered_sources(sender: EmbeddingSender, receiver: EmbeddingReceiver, layout: Layout, *,
                                   tokens: int = 20000, device: str = "cpu") -> None:
    """Run the check on a connected pair whose transport exposes ``regions`` (what it holds registered).
    ``tokens`` rows per buffer, on ``device``. Where the transport reads unregistered memory on ``device``
    (:meth:`~aioembed.transports.base.Transport.reads_unregistered`) the sends outside the buffers register
    nothing either; elsewhere they register their own tensors (or are staged), undone when they end."""
    regions = sender._transport.regions  # type: ignore[union-attr]
    staging_only = len(regions)
    buffers = layout.empty(tokens, device=device)
    kept = await sender.register_sources(*buffers.values())
    registered = len(regions)
    small = min(64, sender.config.staging_max_tokens)
    for i, (at, n) in enumerate([(0, small), (tokens // 20, 300), (0, tokens), (tokens // 4, tokens // 2)]):
        want = deterministic_request(layout, n, f"kept-{i}")
        rows = rows_in(buffers, at, want)
        await send_and_check(sender, receiver, f"kept-{i}", rows, want)
        assert len(regions) == registered, "a send() from registered buffers registered something"
        if i == 1:  # one field outside the buffers: this send registers its own tensors (unless the transport
            # reads unregistered sources), two of them inside the buffers
            first = next(iter(rows))
            await send_and_check(sender, receiver, "mixed", {**rows, first: rows[first].clone()}, want)
            assert len(regions) == registered, "a send()'s own registration was not undone"
    await kept.aclose()
    assert kept.closed and sender.source_buffers == 0
    want = deterministic_request(layout, 4000, "after")
    # Once closed: a send() from the same memory is an ordinary one again (registered for it, or read unregistered).
    await send_and_check(sender, receiver, "after", rows_in(buffers, 0, want), want)
    assert sender.sources_held == 0
    assert len(regions) == staging_only, "the buffers are still registered after aclose()"
