"""The GPU path, for any transport that moves CUDA memory: ordering with streams, and every receive mode.

A plugin runs it by subclassing (compare :class:`~aioembed.testing.TransportConformance`)::

    from aioembed.testing.gpu import CudaSuite

    class TestCuda(CudaSuite):
        transport_name = "ucx"
        transport_options = {"tls": "tcp,cuda_copy,cuda_ipc"}

Every test is marked ``cuda`` and skipped on a host without a CUDA device, or when the transport does
not declare ``capabilities.cuda``: CPU CI collects it and runs none of it.

The race tests are the ones a GPU host found failing: an encoder queues its last kernel and calls
``send()`` at once; a consumer queues kernels on a lease's views and releases it at once. A kernel
that sleeps on the GPU (``torch.cuda._sleep``) makes the queued work land late, so a library that
reads or reuses memory before the stream got there sees the wrong rows.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import anyio
import pytest
import torch

from aioembed.config import TransferConfig
from aioembed.samples import deterministic_request, same_rows, standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender
from aioembed.testing.source_buffers import check_registered_sources, rows_in
from aioembed.transports.registry import resolve_transport

__all__ = ["CudaSuite"]

LAYOUT = standard_layout(256)
SLEEP_CYCLES = 200_000_000
"""GPU clock cycles a queued kernel sleeps before the real work: about 0.1 s on a current GPU."""


def _late() -> None:
    """Queue a kernel that sleeps ``SLEEP_CYCLES`` on the current stream: work queued after it runs late."""
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # untyped in torch


def _stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]


def _on_gpu(rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to("cuda:0") for n, t in rows.items()}


def _to_cpu(rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to("cpu") for n, t in rows.items()}


class CudaSuite:
    """Subclass with ``transport_name`` (and options) to run the GPU tests on a transport."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [
        pytest.mark.anyio, pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ]
    transport_name: ClassVar[str]
    transport_options: ClassVar[Mapping[str, Any]] = {}

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"

    @asynccontextmanager
    async def pair(self, **kw: Any) -> AsyncIterator[tuple[EmbeddingSender, EmbeddingReceiver]]:
        if not resolve_transport(self.transport_name).capabilities.cuda:
            pytest.skip(f"transport {self.transport_name!r} (this build) does not move CUDA memory")
        base: dict[str, Any] = dict(transport=self.transport_name, transport_options=dict(self.transport_options),
                                    device="cuda:0", default_tokens=1024, pool_tokens=4096, resume_reserve_tokens=0)
        base.update(kw)
        cfg = TransferConfig(**base)
        async with EmbeddingSender(LAYOUT, cfg) as sender, \
                EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
            await receiver.wait_connected()
            yield sender, receiver

    # -- the source race -------------------------------------------------------------------------

    async def test_send_waits_for_the_producing_kernel_on_the_current_stream(self) -> None:
        want = _on_gpu(deterministic_request(LAYOUT, 700, "late"))
        async with self.pair() as (sender, receiver):
            src = {n: torch.zeros_like(t) for n, t in want.items()}
            torch.cuda.synchronize()
            _late()  # the encoder's last kernel, still running ...
            for n, t in src.items():
                t.copy_(want[n])  # ... queued after it: the rows exist only once the stream gets here
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "late", src)  # at once, as after model(x)
                got = await receiver.receive("late")
            assert same_rows(_to_cpu(got.tensors), _to_cpu(want)), "rows read before the producing kernel ran"

    async def test_send_waits_for_the_producing_kernel_on_a_side_stream(self) -> None:
        want = _on_gpu(deterministic_request(LAYOUT, 700, "side"))
        async with self.pair() as (sender, receiver):
            src = {n: torch.zeros_like(t) for n, t in want.items()}
            torch.cuda.synchronize()
            side = _stream()
            with torch.cuda.stream(side):
                _late()
                for n, t in src.items():
                    t.copy_(want[n])
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: sender.send("side", src, stream=side))
                got = await receiver.receive("side")
            assert same_rows(_to_cpu(got.tensors), _to_cpu(want)), "rows read before the side stream ran"

    async def test_a_non_contiguous_source_is_made_contiguous_in_stream_order(self) -> None:
        want = _on_gpu(deterministic_request(LAYOUT, 500, "strided"))
        async with self.pair() as (sender, receiver):
            wide = {n: torch.zeros((t.shape[0] * 2, *t.shape[1:]), dtype=t.dtype, device=t.device)
                    for n, t in want.items()}
            torch.cuda.synchronize()
            _late()
            for n, t in wide.items():
                t[::2].copy_(want[n])
            src = {n: t[::2] for n, t in wide.items()}  # strided views: contiguous() is a kernel too
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "strided", src)
                got = await receiver.receive("strided")
            assert same_rows(_to_cpu(got.tensors), _to_cpu(want))

    async def test_a_send_from_registered_buffers_waits_for_the_producing_kernel(self) -> None:
        """Rows written into registered CUDA buffers (``register_sources()``) by a kernel still queued: the
        write straight from the buffers (no staging, no registration per send) waits for it too."""
        want = _on_gpu(deterministic_request(LAYOUT, 700, "kept"))
        async with self.pair() as (sender, receiver):
            buffers = {n: t.zero_() for n, t in LAYOUT.empty(4096, device="cuda:0").items()}
            async with await sender.register_sources(*buffers.values()):
                torch.cuda.synchronize()
                _late()
                src = rows_in(buffers, 1000, want)  # copies queued after the late kernel
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sender.send, "kept", src)
                    got = await receiver.receive("kept")
                assert sender.source_buffers == 1
            assert same_rows(_to_cpu(got.tensors), _to_cpu(want)), "rows read before the producing kernel ran"
            assert sender.source_buffers == 0 and sender.sources_held == 0

    async def test_registered_cuda_buffers_bit_for_bit_with_no_registration_per_send(self) -> None:
        async with self.pair() as (sender, receiver):
            if not hasattr(sender._transport, "regions"):
                pytest.skip(f"transport {self.transport_name!r} does not expose its registered regions")
            await check_registered_sources(sender, receiver, LAYOUT, tokens=4096, device="cuda:0")

    # -- the consumer race ------------------------------------------------------------------------

    async def test_a_released_lease_is_reused_only_after_its_consumer_read_it(self) -> None:
        first = _on_gpu(deterministic_request(LAYOUT, 1024, "first"))
        second = _on_gpu(deterministic_request(LAYOUT, 1024, "second"))
        async with self.pair(default_tokens=1024, pool_tokens=1024) as (sender, receiver):  # one room fills it
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "first", first)
                lease = await receiver.receive_leased("first")
            seen = {n: torch.empty_like(t) for n, t in first.items()}
            _late()  # the consumer's kernels, queued on the views, run late ...
            for n, views in lease.views.items():
                at = 0
                for v in views:
                    seen[n][at:at + v.shape[0]].copy_(v)
                    at += v.shape[0]
            lease.release()  # ... and the lease is released at once: its blocks must wait for them
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "second", second)  # lands in the same blocks once they are free
                again = await receiver.receive_leased("second")
            torch.cuda.synchronize()
            assert same_rows(_to_cpu(seen), _to_cpu(first)), "the next room overwrote rows a kernel still read"
            assert same_rows(_to_cpu(again.to_tensors()), _to_cpu(second))
            again.release()

    @pytest.mark.parametrize("where", ["current", "side"])
    async def test_a_copy_into_out_waits_for_kernels_still_reading_it(self, where: str) -> None:
        """``receive(out=X)`` right after queuing kernels that read X (the previous request's rows): the copy
        out of the pool (on a stream of its own) must not overwrite X before they ran. On torch's default
        stream a new stream waits for it anyway (legacy default-stream semantics); a caller whose model runs
        on a side stream, current while it asks, is the case only the copy's explicit wait covers."""
        first = _on_gpu(deterministic_request(LAYOUT, 700, "prev"))
        second = _on_gpu(deterministic_request(LAYOUT, 700, "next"))
        async with self.pair() as (sender, receiver):
            out = {n: t.clone() for n, t in first.items()}  # X holds the previous request's rows
            seen = {n: torch.empty_like(t) for n, t in first.items()}
            torch.cuda.synchronize()
            with torch.cuda.stream(_stream() if where == "side" else torch.cuda.current_stream()):
                _late()  # the model's kernels reading X, queued on the caller's stream, run late ...
                for n, t in out.items():
                    seen[n].copy_(t)
                async with anyio.create_task_group() as tg:  # ... and the next request is received into X at once
                    # (its rows are ready: the sender must not wait for the caller's stream, or the rows land late)
                    tg.start_soon(lambda: sender.send("next", second, stream=_stream()))
                    got = await receiver.receive("next", out=out)
            torch.cuda.synchronize()
            assert same_rows(_to_cpu(seen), _to_cpu(first)), "the copy-out overwrote out= before kernels read it"
            assert same_rows(_to_cpu(got.tensors), _to_cpu(second))

    @pytest.mark.parametrize("out_device", [None, "cuda:0", "cpu"])
    async def test_a_copying_receive_chunks_only_copies_that_leave_the_gpu(self, out_device: str | None) -> None:
        """``copy_chunk_tokens`` overlaps the copy-out with the writes. A copy from a CUDA pool into GPU memory
        is far faster than the writes into the pool, so its round is copied whole, once; ``out=`` on the CPU
        (a slow device-to-host copy) still asks for chunks, each copied whole as it lands (chunks that have
        landed together in one go)."""
        want = deterministic_request(LAYOUT, 1000, f"whole-{out_device}")
        async with self.pair(copy_chunk_tokens=256) as (sender, receiver):
            assert receiver._room_ctx is not None
            copier = receiver._room_ctx.copier
            inner = copier.copy
            copies: list[tuple[int, int]] = []

            async def spy(blocks: Any, out: dict[str, torch.Tensor], start: int, count: int, **kw: Any) -> None:
                copies.append((start, count))
                await inner(blocks, out, start, count, **kw)

            copier.copy = spy  # type: ignore[method-assign]
            new_driver = receiver._new_driver
            chunk_tokens: list[int] = []

            def spy_driver(*args: Any, **kwargs: Any) -> Any:
                driver = new_driver(*args, **kwargs)
                chunk_tokens.append(driver.progress_tokens)
                return driver

            receiver._new_driver = spy_driver  # type: ignore[method-assign]
            out = LAYOUT.empty(1000, device=out_device) if out_device else None
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "whole", _on_gpu(want))
                got = await receiver.receive("whole", out=out)
            assert same_rows(_to_cpu(got.tensors), want)
            if out_device == "cpu":
                assert len(chunk_tokens) == 1 and chunk_tokens[0] >= 256, chunk_tokens  # the room asked for chunks
                assert [s for s, _ in copies] == [sum(c for _, c in copies[:i]) for i in range(len(copies))]
                assert sum(c for _, c in copies) == 1000
                assert all(s % chunk_tokens[0] == 0 for s, _ in copies), f"a chunk copied in parts: {copies}"
            else:
                assert chunk_tokens == [0], chunk_tokens
                assert copies == [(0, 1000)], f"one copy of the whole round expected, got {copies}"

    # -- every receive mode ------------------------------------------------------------------------

    @pytest.mark.parametrize("mode", ["receive", "out_gpu", "out_cpu", "leased"])
    async def test_every_receive_mode_bit_for_bit(self, mode: str) -> None:
        want = deterministic_request(LAYOUT, 2500, mode)  # several rounds of 1024
        async with self.pair() as (sender, receiver):
            src = _on_gpu(want)
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, mode, src)
                if mode == "leased":
                    lease = await receiver.receive_leased(mode)
                    rows = lease.to_tensors()
                    lease.release()
                else:
                    device = "cpu" if mode == "out_cpu" else "cuda:0"
                    out = LAYOUT.empty(2500, device=device) if mode.startswith("out") else None
                    rows = (await receiver.receive(mode, out=out)).tensors
                    if out is not None:
                        assert all(rows[n].data_ptr() == out[n].data_ptr() for n in out)
            assert same_rows(_to_cpu(rows), want)
