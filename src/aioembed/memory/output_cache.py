"""Fresh ``receive()`` outputs made from the memory of outputs the caller has let go of.

A copying ``receive()`` hands the caller new tensors, and the first write to new memory costs page
faults: the kernel maps and zeroes every page before the copy can fill it. On the 2-core development
host, receiving 8192 tokens of the standard layout (59 MB, two processes over Mooncake TCP) ran at
1.30 GB/s into a fresh output on huge pages (:mod:`aioembed.memory.huge_pages`) against 1.49 GB/s into
memory already touched; with ordinary 4 KiB pages a fresh 59 MB copy alone took 40 ms against 9 ms.
The C allocator does not keep such blocks: above its mmap threshold (32 MiB at most in glibc) every
free unmaps and every allocation maps anew.

Small requests pay the same per byte: with 32 requests of 64 tokens in flight (a 458 KB embeddings
field each) a receiving process took about 110 page faults per request, and each copy-out took 0.28 ms
against 0.05 ms into reused memory (the C allocator trims and maps such blocks again as they come
and go).

So a receiver keeps that memory itself. A field of at least :data:`SPAN_MIN_BYTES` is lent from a
*span*, through a small exporter object that the tensor's storage holds (``torch.frombuffer``): a
large field (at least :data:`HUGE_PAGE_MIN_BYTES`) from a span of a multiple of the huge page size,
on huge pages; a smaller one on ordinary pages, from a span of the next power of two up to 4 MiB and
of a multiple of 2 MiB above (so span sizes stay few, and a field is never lent a span of more than
twice its size). When the caller lets go of the tensor and of every view of it, the storage releases
the exporter, and a finalizer gives the span back for the next output. A span is thus never handed
out while any tensor can still reach its memory. Idle spans are bounded by ``output_cache_bytes``
(the oldest are freed first; a span larger than the bound is never kept), and closing the receiver
frees them.

Finalizers run on whatever thread drops the last reference, possibly inside a garbage collection
that interrupts this module on its own thread. So a finalizer only queues its span; the queue is
settled by whoever holds the lock, and whoever lets go of the lock looks at the queue again.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from aioembed.layout import Layout
from aioembed.memory.huge_pages import HUGE_PAGE_BYTES, HUGE_PAGE_MIN_BYTES, huge_page_memory
from aioembed.memory.output import empty_output

__all__ = ["SPAN_MIN_BYTES", "OutputCache", "OutputCacheStats", "span_bytes"]

SPAN_MIN_BYTES = 64 << 10
"""Fields smaller than this are ordinary allocations: the C allocator reuses such blocks without faults."""


_POWER_OF_TWO_MAX = 4 << 20


def span_bytes(nbytes: int) -> int:
    """The size of a new span for a field of ``nbytes``: the next power of two up to 4 MiB, else the next
    multiple of the huge page size."""
    if nbytes > _POWER_OF_TWO_MAX:
        return -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    return 1 << max(0, nbytes - 1).bit_length()


@dataclass
class OutputCacheStats:
    """Counters of an :class:`OutputCache` (read them from any thread; they are plain ints)."""

    hits: int = 0
    """Fields made from an idle span."""
    misses: int = 0
    """Fields (of at least :data:`SPAN_MIN_BYTES`) that needed new memory."""
    lent: int = 0
    """Spans held by callers' tensors now."""
    idle_bytes: int = 0
    """Bytes of idle spans kept for the next outputs (at most the capacity)."""
    freed: int = 0
    """Spans let go of (to the C allocator or the OS): beyond the capacity, larger than it, or after close."""


class _Span:
    """Memory for one field; ``memory`` is never handed out itself, only lent through exporters."""

    __slots__ = ("memory", "nbytes")

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.nbytes = memory.numel()


class OutputCache:
    """Makes fresh outputs for one receiver, reusing the memory of outputs the caller dropped (see the
    module docstring). ``capacity_bytes`` bounds the idle memory kept; 0 keeps none."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.stats = OutputCacheStats()
        self._idle: OrderedDict[_Span, None] = OrderedDict()  # oldest first
        self._by_size: dict[int, list[_Span]] = {}  # the idle spans of each size, last given back last
        self._returned: deque[_Span] = deque()
        self._lock = threading.Lock()
        self._closed = False

    def empty(self, layout: Layout, num_tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Uninitialised tensors for ``num_tokens`` tokens of every field of ``layout`` on ``device``, as
        :func:`~aioembed.memory.output.empty_output` makes them, CPU fields of at least
        :data:`SPAN_MIN_BYTES` from this cache."""
        if self.capacity <= 0 or self._closed:
            return empty_output(layout, num_tokens, device)
        return empty_output(layout, num_tokens, device, large=self._lend, min_bytes=SPAN_MIN_BYTES)

    def close(self) -> None:
        """Free the idle spans; spans given back from now on are freed too. Idempotent."""
        with self._lock:
            self._closed = True
            freed = list(self._idle)
            self._idle.clear()
            self._by_size.clear()
            self.stats.idle_bytes = 0
            self.stats.freed += len(freed)
            self._settle_locked(freed)
        self._settle()

    def _lend(self, nbytes: int) -> torch.Tensor:
        need = span_bytes(nbytes)
        freed: list[_Span] = []
        with self._lock:
            self._settle_locked(freed)
            span = self._best_fit(need, nbytes)
            if span is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            self.stats.lent += 1
        self._settle()
        del freed  # unmapped here, outside the lock
        try:
            if span is None:
                span = _Span(huge_page_memory(need) if nbytes >= HUGE_PAGE_MIN_BYTES
                             else torch.empty(need, dtype=torch.uint8))
            # An exporter the size of the span, not of the field: ctypes keeps every array type it
            # ever made, and spans come in far fewer sizes (multiples of the huge page, powers of two)
            # than fields.
            exporter = (ctypes.c_ubyte * span.nbytes).from_address(span.memory.data_ptr())
            tensor = torch.frombuffer(exporter, dtype=torch.uint8, count=nbytes)
        except BaseException:
            with self._lock:  # no tensor was made: the span (if any) is simply dropped
                self.stats.lent -= 1
            self._settle()
            raise
        returned = weakref.finalize(exporter, self._give_back, span)
        returned.atexit = False  # nothing to give back at interpreter exit
        return tensor

    def _best_fit(self, need: int, nbytes: int) -> _Span | None:
        """For a field of ``nbytes``: take an idle span of the smallest size from ``need`` bytes (its new
        span's size) up to twice the field (a much larger one would sit mostly unused while lent; it stays
        for a request of its size), the one given back last (its memory is likeliest still in cache).
        Lock held."""
        size = min((n for n in self._by_size if need <= n <= 2 * nbytes), default=None)
        if size is None:
            return None
        same = self._by_size[size]
        span = same.pop()
        if not same:
            del self._by_size[size]
        del self._idle[span]
        self.stats.idle_bytes -= span.nbytes
        return span

    def _give_back(self, span: _Span) -> None:
        """The finalizer of a lent span's exporter: no tensor reaches the span's memory any more."""
        self._returned.append(span)
        self._settle()

    def _settle(self) -> None:
        """Settle the spans given back, unless another holder of the lock will (it looks again after)."""
        while self._returned:
            if not self._lock.acquire(blocking=False):
                return
            freed: list[_Span] = []
            try:
                self._settle_locked(freed)
            finally:
                self._lock.release()
            del freed

    def _settle_locked(self, freed: list[_Span]) -> None:
        """Move given-back spans to the idle list, oldest idle ones out beyond the capacity (into
        ``freed``, dropped by the caller after the lock). Lock held."""
        while self._returned:
            span = self._returned.popleft()
            self.stats.lent -= 1
            if self._closed or span.nbytes > self.capacity:
                freed.append(span)
                self.stats.freed += 1
                continue
            self._idle[span] = None
            self._by_size.setdefault(span.nbytes, []).append(span)
            self.stats.idle_bytes += span.nbytes
            while self.stats.idle_bytes > self.capacity:
                old, _ = self._idle.popitem(last=False)
                same = self._by_size[old.nbytes]
                same.remove(old)  # the oldest of its size: first in its list
                if not same:
                    del self._by_size[old.nbytes]
                self.stats.idle_bytes -= old.nbytes
                freed.append(old)
                self.stats.freed += 1
