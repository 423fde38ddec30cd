"""Ordering with CUDA streams: memory is ready when its producer's stream reaches it, and free when
its consumer's stream is done with it, not when a Python call returns.

* A source tensor that a kernel is still filling (``send()`` right after ``model(x)``) must not be read
  by a transport before the producing stream gets there: :func:`fence_after` records an event on that
  stream, and the writes wait for it (in a worker thread, never blocking the event loop).
* Rows that a consumer's kernels still read (a :class:`~aioembed.Lease`'s views) must not be handed
  to another room before those kernels are done: the lease records an event on the consumer's stream
  when it is released, and its blocks go back only once the event has completed.
* Never ``torch.cuda.synchronize()`` a device the language model is using: it waits for every kernel
  queued there. Copies out of a CUDA pool run on a private stream and wait for their own event.

For CPU memory there is nothing to order: :func:`fence_after` returns ``None``. The :class:`Fence`
protocol lets the session code be tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import anyio
import torch

__all__ = ["CudaFence", "Fence", "fence_after", "wait_fence"]


class Fence(Protocol):
    """A point in a device's work queue."""

    def done(self) -> bool:
        """True once the work queued before the fence has completed (never blocks)."""
        ...

    def wait(self) -> None:
        """Block the calling thread until :meth:`done` (call it in a worker thread)."""
        ...


class CudaFence:
    """A CUDA event recorded on a stream."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
        self.event.record(stream)

    def done(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self.event.synchronize()


def fence_after(tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream | None = None) -> Fence | None:
    """A fence after the work queued so far on ``stream`` (default: the current stream of the tensors'
    CUDA device); ``None`` when no tensor is on a CUDA device."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    if not devices:
        return None
    if stream is None:
        if len(devices) > 1:
            raise ValueError(f"tensors on several CUDA devices {sorted(map(str, devices))}: pass the stream "
                             "that produced them")
        stream = torch.cuda.current_stream(devices.pop())
    return CudaFence(stream)


async def wait_fence(fence: Fence | None, limiter: anyio.CapacityLimiter | None = None) -> None:
    """Wait until ``fence`` is done, without blocking the event loop (a worker thread waits)."""
    if fence is None or fence.done():
        return
    await anyio.to_thread.run_sync(fence.wait, limiter=limiter)
