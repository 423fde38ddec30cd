"""Source buffers a caller registers once with the sender's transport, so that ``send()`` from them neither
copies rows into the staging area nor registers and unregisters the caller's tensors.

Per-send registration is what a server pays on RDMA for every request (pinning tens of MB costs
milliseconds), and small requests pay a staging copy instead. A server whose encoder writes its
outputs into long-lived buffers (preallocated outputs, CUDA graphs' static outputs) registers them
once, as raw transfer-engine users do. The caller vouches for their lifetime: a buffer stays
registered, and alive, until :meth:`RegisteredSources.aclose`.

Why not a registration cache instead (see :mod:`aioembed.memory.staging`): keeping memory registered
after ``send()`` is only safe while it stays alive, which only the caller can promise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Self

import anyio
import torch

from aioembed.errors import InvalidRequest
from aioembed.layout import bytes_are_values
from aioembed.transports.base import MemoryRegion

__all__ = ["RegisteredSources", "SourceBufferIndex", "check_source_tensors"]


class RegisteredSources:
    """Tensors registered with a sender's transport until :meth:`aclose` (or the sender's close).

    A ``send()`` whose every field lies inside these tensors (slices of them: ``buf[:n]``) is written from
    them directly. :meth:`aclose` stops new sends from using them, waits until no write reads them (a write
    that failed and may still be moving keeps them for its transport's write lifetime), then unregisters.
    Use ``async with await sender.register_sources(...)`` or call :meth:`aclose`.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], regions: Sequence[MemoryRegion],
                 start_close: Callable[[RegisteredSources], None]) -> None:
        self.tensors = tuple(tensors)
        """Kept referenced while registered: their memory cannot be freed under a write."""
        self.regions = tuple(regions)
        self._start_close = start_close
        self._uses = 0
        self._idle = anyio.Event()
        self._idle.set()
        self.closing = False
        """No new ``send()`` uses them (:meth:`aclose` began, or the sender closed)."""
        self._closed = anyio.Event()

    @property
    def in_use(self) -> int:
        """Sources of sends (and of writes that may still land) that read these tensors now."""
        return self._uses

    @property
    def closed(self) -> bool:
        """Unregistered (or dropped with the sender's transport)."""
        return self._closed.is_set()

    def covers(self, region: MemoryRegion) -> bool:
        return not self.closing and any(r.device == region.device and r.address <= region.address
                                        and region.end <= r.end for r in self.regions)

    def acquire(self) -> None:
        self._uses += 1
        if self._uses == 1:
            self._idle = anyio.Event()

    def release(self) -> None:
        if self._uses <= 0:
            raise RuntimeError("registered sources released more often than acquired")
        self._uses -= 1
        if self._uses == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no source reads them."""
        await self._idle.wait()

    def mark_closed(self) -> None:
        self.closing = True
        self._closed.set()

    async def aclose(self) -> None:
        """Stop using them for new sends, wait until no write reads them, unregister. Idempotent; every call
        returns once they are unregistered. Cancelling the call does not stop that (the sender finishes it)."""
        if not self.closing:
            self.closing = True
            self._start_close(self)
        await self._closed.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class SourceBufferIndex:
    """The sender's registered source buffers: which one a request's tensors lie in."""

    def __init__(self) -> None:
        self._live: list[RegisteredSources] = []

    def __len__(self) -> int:
        return len(self._live)

    def add(self, sources: RegisteredSources) -> None:
        self._live.append(sources)

    def discard(self, sources: RegisteredSources) -> None:
        if sources in self._live:
            self._live.remove(sources)

    def all(self) -> list[RegisteredSources]:
        return list(self._live)

    def covering(self, tensors: Iterable[torch.Tensor]) -> RegisteredSources | None:
        """The one registration every tensor lies inside (contiguous, on its device, its bytes its values: a
        conjugate view's rows are written from a resolved copy), acquired for the caller (who releases it); ``None``
        if there is none."""
        if not self._live:
            return None
        regions = []
        for t in tensors:
            if t.device.type not in ("cpu", "cuda") or not t.is_contiguous() or not bytes_are_values(t):
                return None  # (a tensor on another device is refused by the send(), naming it)
            regions.append(MemoryRegion.of_tensor(t))
        for live in self._live:
            if all(live.covers(r) for r in regions):
                live.acquire()
                return live
        return None


def check_source_tensors(tensors: Sequence[torch.Tensor], *, cuda: bool) -> list[MemoryRegion]:
    """The regions of tensors a caller asks to register: contiguous, non-empty, on a device the transport
    moves."""
    if not tensors:
        raise InvalidRequest("register_sources() needs at least one tensor")
    regions = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise InvalidRequest(f"register_sources(): argument {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided or not t.is_contiguous():
            raise InvalidRequest(f"register_sources(): tensor {i} is not contiguous (strides {t.stride()}): only "
                                 "contiguous memory is one registration")
        if t.numel() == 0:
            raise InvalidRequest(f"register_sources(): tensor {i} is empty")
        if t.device.type not in ("cpu", "cuda") or (t.device.type == "cuda" and not cuda):
            raise InvalidRequest(f"register_sources(): tensor {i} is on {t.device}; the transport moves "
                                 f"{'CPU and CUDA' if cuda else 'CPU'} memory")
        regions.append(MemoryRegion.of_tensor(t))
    return regions
