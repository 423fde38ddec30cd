"""Copying a landed round out of the pool into the caller's (or a fresh) output.

Small copies run on the loop (a thread hop costs more than the copy); large CPU copies are split
by whole blocks across the copy threads, since a copy into fresh memory is dominated by page
faults and memory bandwidth, which several cores share out.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import anyio
import torch

from aioembed.memory.device_order import CudaFence
from aioembed.memory.pool import BlockPool

__all__ = ["COPY_INLINE_BYTES", "RoundCopier"]

COPY_INLINE_BYTES = 4 << 20
"""Below this, a copy-out runs on the loop."""


class RoundCopier:
    """Copies rounds out of one pool, through ``threads`` worker threads at most."""

    def __init__(self, pool: BlockPool, *, threads: int) -> None:
        self.pool = pool
        self.limiter = anyio.CapacityLimiter(threads)
        self.threads = threads
        self._stream: torch.cuda.Stream | None = None

    def _copy_cuda(self, blocks: Sequence[int], out: dict[str, torch.Tensor], start: int, count: int, *,
                   after: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
        """In a worker thread: the copy on a private stream, waited for by its own event (never a
        device-wide synchronize: the language model's kernels on that GPU are not waited for). A copy
        into CPU memory (``out=``) is a device-to-host copy: it blocks this thread, never the loop.

        The copy is queued after the work already on ``after`` (the caller's stream when it asked): kernels
        there may still read the caller's ``out=`` (its previous request's rows), and a fresh output was
        allocated in that stream's order (the caching allocator may hand out memory kernels queued there
        still use).

        ``stream`` is the private one, passed in rather than read from ``self``: it is made once, on the loop's
        thread (made in the worker threads, two copies starting together each made one and stored it, and a copy
        could run on one and wait for the other's event, its blocks freed while it still read them)."""
        stream.wait_stream(after)
        with torch.cuda.stream(stream):
            self.pool.copy_out(blocks, count, out, out_start=start)
        CudaFence(stream).wait()

    async def copy(self, blocks: Sequence[int], out: dict[str, torch.Tensor], start: int, count: int, *,
                   spread: bool = True, after: torch.cuda.Stream | None = None) -> None:
        """Rows of ``blocks`` (``count`` tokens) into ``out[...][start:start + count]``. ``spread=False``: one
        thread, for a chunk copied while the rest of its round is still being written (the transport needs
        the other cores meanwhile). ``after``: a CUDA pool's copy waits for the work queued on this stream
        (the caller's when it asked for the room; default: the current one)."""
        pool = self.pool
        nbytes = count * pool.layout.bytes_per_token
        if pool.device.type == "cuda":
            if after is None:
                after = torch.cuda.current_stream(pool.device)
            if self._stream is None:
                self._stream = torch.cuda.Stream(pool.device)  # type: ignore[no-untyped-call]
            copy = functools.partial(self._copy_cuda, blocks, out, start, count, after=after, stream=self._stream)
            await anyio.to_thread.run_sync(copy, limiter=self.limiter)
            return
        if nbytes <= COPY_INLINE_BYTES:
            pool.copy_out(blocks, count, out, out_start=start)
            return
        bs = pool.block_size
        # Only the blocks that hold rows: a round's grant holds its whole reservation, and parts split over blocks
        # past its rows would copy nothing (a request a quarter of its reservation took one thread of four).
        blocks = blocks[:-(-count // bs)]
        parts = max(1, min(self.threads if spread else 1, nbytes // COPY_INLINE_BYTES))
        per = -(-len(blocks) // parts)

        def part(b0: int) -> None:
            n = min(count - b0 * bs, per * bs)
            pool.copy_out(blocks[b0:b0 + per], n, out, out_start=start + b0 * bs)

        async with anyio.create_task_group() as tg:
            for b0 in range(0, len(blocks), per):
                if count - b0 * bs > 0:
                    tg.start_soon(functools.partial(anyio.to_thread.run_sync, part, b0, limiter=self.limiter))
