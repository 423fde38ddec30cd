"""Tensors whose values are not their bytes: a conjugate view (``x.conj()`` of a complex field) or a negative view
(``torch._neg_view``) is contiguous, but torch applies its bit when the tensor is read. A transport moves bytes,
so such a source must be materialised before a write reads it, and a copy into such an ``out=`` must go through
torch; otherwise the receiver gets (or the caller reads) the conjugates of the rows sent, silently."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest
import torch

from aioembed import EmbeddingReceiver, EmbeddingSender, Field, Layout, TransferConfig
from aioembed.testing import MockTransport
from aioembed.testing.source_buffers import rows_in

pytestmark = pytest.mark.anyio

LAYOUT = Layout(emb=Field((4,), torch.complex64), ids=Field((), torch.int32))
CFG = TransferConfig(default_tokens=512, pool_tokens=4096, staging_tokens=512, staging_max_tokens=256,
                     handshake_timeout=2.0, input_timeout=5.0, room_timeout=10.0)

SMALL, LARGE = 64, 1000  # staged; registered (or read where it lies) by the send()


def _request(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(n, 4, dtype=torch.complex64, generator=g),
            "ids": torch.randint(0, 1 << 30, (n,), dtype=torch.int32, generator=g)}


def _conj(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**rows, "emb": rows["emb"].conj()}


def _neg(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**rows, "ids": torch._neg_view(rows["ids"])}


def _same_values(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[n].resolve_conj().resolve_neg(), want[n].resolve_conj().resolve_neg()) for n in want)


@asynccontextmanager
async def _pair(*, unregistered: bool = False) -> AsyncIterator[tuple[EmbeddingSender, EmbeddingReceiver]]:
    writer = MockTransport(unregistered_sources=unregistered)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        yield sender, receiver


async def _send(sender: EmbeddingSender, receiver: EmbeddingReceiver, room: str, rows: dict[str, torch.Tensor],
                out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.send, room, rows)
        got = await receiver.receive(room, out=out)
    return got.tensors


@pytest.mark.parametrize("lazy", [_conj, _neg], ids=["conj", "neg"])
@pytest.mark.parametrize("unregistered", [False, True], ids=["registering", "reads-unregistered"])
async def test_a_lazy_view_is_sent_as_its_values(lazy: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                                                 unregistered: bool) -> None:
    async with _pair(unregistered=unregistered) as (sender, receiver):
        for n in (SMALL, LARGE):
            rows = lazy(_request(n, seed=n))
            assert all(t.is_contiguous() for t in rows.values())
            got = await _send(sender, receiver, f"r{n}", rows)
            assert _same_values(got, rows), f"{n} tokens: the receiver got the raw bytes, not the values"
        assert sender.sources_held == 0


async def test_a_lazy_view_of_registered_buffers_is_sent_as_its_values() -> None:
    """Inside buffers given to register_sources(), a conjugate view's bytes are the unconjugated rows: it must not
    be written from the registration as it lies."""
    async with _pair() as (sender, receiver):
        buffers = LAYOUT.empty(2048)
        async with await sender.register_sources(*buffers.values()):
            for n in (SMALL, LARGE):
                want = _request(n, seed=n)
                rows = _conj(rows_in(buffers, 0, _conj(want)))  # the buffer holds conj(want): the view reads want
                assert torch.equal(rows["emb"].resolve_conj(), want["emb"])
                got = await _send(sender, receiver, f"r{n}", rows)
                assert _same_values(got, want), f"{n} tokens: the receiver got the buffer's bytes, not the values"
        assert sender.sources_held == 0


async def test_a_copy_into_a_lazy_out_leaves_the_values_sent() -> None:
    async with _pair() as (sender, receiver):
        for n in (SMALL, LARGE):
            want = _request(n, seed=n)
            out = {"emb": torch.zeros(n, 4, dtype=torch.complex64).conj(),
                   "ids": torch._neg_view(torch.zeros(n, dtype=torch.int32))}
            got = await _send(sender, receiver, f"r{n}", want, out=out)
            assert _same_values(out, want), f"{n} tokens: out= read back is not the rows sent"
            assert _same_values(got, want)


async def test_tensors_that_require_grad_are_moved_without_autograd() -> None:
    """An encoder run outside ``no_grad`` / ``inference_mode`` hands over tensors that require grad, and a caller may
    pass such an ``out=``. Moved through ``copy_`` (a strided source staged, a conjugate ``out=``) with autograd on,
    the sender's staging area joined the source's graph (keeping every such source alive) and the copy into ``out=``
    raised once the rows had landed ("a view of a leaf Variable that requires grad ...")."""
    async with _pair() as (sender, receiver):
        want = _request(SMALL, seed=5)
        wide = torch.stack([want["emb"], torch.zeros_like(want["emb"])], dim=2).reshape(SMALL, 8).requires_grad_()
        src = {**want, "emb": wide[:, ::2]}  # strided, requires grad: staged through copy_
        leaf = torch.zeros(SMALL, 4, dtype=torch.complex64, requires_grad=True)
        out = {"emb": leaf.conj(), "ids": torch.zeros(SMALL, dtype=torch.int32)}  # conjugate: filled through copy_
        got = await _send(sender, receiver, "grad", src, out=out)
        assert _same_values({n: t.detach() for n, t in out.items()}, want)
        assert _same_values({n: t.detach() for n, t in got.items()}, want)
        assert sender._staging is not None
        assert not any(t.requires_grad for t in sender._staging.tensors.values()), "staging joined a graph"
