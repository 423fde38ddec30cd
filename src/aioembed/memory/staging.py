"""The sender's staging area: small requests are copied into memory registered once, instead of
registering the caller's tensors for every ``send()``.

Registering memory with a transport costs a native call (and, for RDMA, pinning pages) each way; for
a small request that costs more than copying its rows. So the sender keeps one registered tensor per
layout field, ``capacity`` rows each, and hands out contiguous row ranges of it (the same range in
every field). A range goes back only when no write may still read it (the sender's write ledger says
when: a poisoned write keeps reading its source until its transport's write lifetime passed).

Why not a registration cache instead: keeping the caller's memory registered after ``send()`` is only
safe while that memory stays alive. A freed buffer can be unmapped and another mapped at the same
address, and a registration kept from before would then read the *old* pages; a cache that pins the
caller's tensors to prevent that helps only callers that reuse their buffers.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from aioembed.errors import AllocatorError, ConfigError
from aioembed.layout import Layout, bytes_are_values
from aioembed.transports.base import MemoryRegion

__all__ = ["RangeAllocator", "StagedRows", "StagingArea"]


class RangeAllocator:
    """First-fit allocation of contiguous ranges of ``capacity`` units (sans-IO, never waits)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise AllocatorError(f"a range allocator needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0]  # free runs, sorted by start; adjacent runs are merged on free
        self._lengths: dict[int, int] = {0: capacity}
        self._taken: dict[int, int] = {}
        self.used = 0

    def take(self, n: int) -> int | None:
        """Start of a free run of ``n`` units, now taken; ``None`` if no run is long enough."""
        if n < 1:
            raise AllocatorError(f"cannot take {n} units")
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length >= n:
                del self._lengths[start]
                if length == n:
                    del self._starts[i]
                else:
                    self._starts[i] = start + n
                    self._lengths[start + n] = length - n
                self._taken[start] = n
                self.used += n
                return start
        return None

    def give(self, start: int) -> None:
        """Give back the run taken at ``start`` (merged with free neighbours)."""
        n = self._taken.pop(start, None)
        if n is None:
            raise AllocatorError(f"no range taken at {start} (double free?)")
        self.used -= n
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and (prev := self._starts[i - 1]) + self._lengths[prev] == start:  # merge with the run before
            start, n = prev, self._lengths.pop(prev) + n
            i -= 1
            del self._starts[i]
        if i < len(self._starts) and self._starts[i] == start + n:  # and with the run after
            n += self._lengths.pop(self._starts[i])
            del self._starts[i]
        self._starts.insert(i, start)
        self._lengths[start] = n

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass(frozen=True, slots=True)
class StagedRows:
    """A request's rows copied into the staging area: ``tensors`` are views of it."""

    start: int
    tensors: dict[str, torch.Tensor]


class StagingArea:
    """``capacity`` rows of every layout field in CPU memory the sender registers once."""

    def __init__(self, layout: Layout, capacity: int, max_tokens: int) -> None:
        self.layout = layout
        self.max_tokens = max_tokens
        self._ranges = RangeAllocator(capacity)
        try:
            self.tensors = layout.empty(capacity)
            for t in self.tensors.values():
                t.zero_()  # every page touched once here, not on the hot path
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory errors are RuntimeErrors
            raise ConfigError(f"the sender's staging area of {capacity} tokens x {layout.bytes_per_token} B cannot "
                              f"be allocated (staging_tokens): {exc}") from exc

    def regions(self) -> list[MemoryRegion]:
        """What to register with the transport (once)."""
        return [MemoryRegion.of_tensor(t) for t in self.tensors.values()]

    def stage(self, tensors: Mapping[str, torch.Tensor], num_tokens: int) -> StagedRows | None:
        """Copy a small CPU request in; ``None`` if it is too large, on a GPU, or the area is full."""
        if num_tokens > self.max_tokens or any(t.device.type != "cpu" for t in tensors.values()):
            return None
        start = self._ranges.take(num_tokens)
        if start is None:
            return None
        out = {}
        try:
            for name, area in self.tensors.items():
                dst = area[start:start + num_tokens]
                src = tensors[name]
                if src.is_contiguous() and bytes_are_values(src):  # (a conjugate view: copy_ applies its bit)
                    # One memmove on this thread: torch's copy_ of a few hundred KB goes to its intra-op
                    # threads, whose hand-off costs far more than the copy on a busy 2-core host.
                    ctypes.memmove(dst.data_ptr(), src.data_ptr(), num_tokens * self.layout[name].row_bytes)
                else:
                    with torch.no_grad():  # bytes, not math: see BlockPool.copy_out
                        dst.copy_(src)
                out[name] = dst
        except BaseException:
            self._ranges.give(start)  # nothing was sent from them: the rows go back
            raise
        return StagedRows(start, out)

    def release(self, rows: StagedRows) -> None:
        """No write reads ``rows`` any more: the range may be handed out again."""
        self._ranges.give(rows.start)

    @property
    def used(self) -> int:
        """Rows handed out and not released."""
        return self._ranges.used
