"""Fresh output tensors for a copying ``receive()``, backed by huge pages where the OS allows.

A copying receive writes every byte of a freshly allocated output once. With 4 KiB pages the first
touch of each page is a fault (zeroing the page and mapping it), and for an 8192-token request of the
standard layout (59 MB) those faults took longer than the copy itself: 22 ms against 4.6 ms into
memory already touched, on the 2-core development machine. Transparent huge pages fault 2 MiB at a
time, 512 times fewer: the same fresh copy took 6.1 ms.

Linux grants huge pages to anonymous memory that asks for them (``madvise(MADV_HUGEPAGE)``) when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (the common default) or ``always``.
So a large field is allocated with 2 MiB of slack, its start aligned to 2 MiB inside that block,
and the range advised before anything touches it. The slack is address space, not memory: pages
never touched are never backed. Where the advice is refused (no THP in the kernel, not Linux) the
tensor is used as it is, with ordinary pages.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections.abc import Callable
from typing import Any

import torch

from aioembed.layout import Layout

__all__ = ["HUGE_PAGE_BYTES", "HUGE_PAGE_MIN_BYTES", "empty_output", "huge_page_memory"]

log = logging.getLogger("aioembed.memory.output")

HUGE_PAGE_BYTES = 2 << 20
"""The transparent huge page size on x86-64 and (with 4 KiB base pages) arm64."""
HUGE_PAGE_MIN_BYTES = 4 * HUGE_PAGE_BYTES
"""Fields smaller than this get ordinary pages: the saving is small there, and the last huge page,
partly used, would weigh more against the field's size."""

class _HugePageAdvisor:
    """Asks the kernel for huge pages (``madvise``), and stops asking once it refused."""

    def __init__(self) -> None:
        self._advice: int | None = getattr(mmap, "MADV_HUGEPAGE", None) if sys.platform == "linux" else None
        self._madvise: Any = None
        if self._advice is not None:
            try:
                self._madvise = ctypes.CDLL(None, use_errno=True).madvise
            except (OSError, AttributeError):  # no C library symbol to call: ordinary pages
                return
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise.restype = ctypes.c_int

    def tensor(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of uninitialised memory (a uint8 tensor) starting on a huge-page boundary and
        advised for huge pages; ``None`` where the OS refuses the advice."""
        if self._madvise is None:
            return None
        span = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        block = torch.empty(span + HUGE_PAGE_BYTES, dtype=torch.uint8)
        base = block.data_ptr()
        start = -(-base // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        if self._madvise(start, span, self._advice) != 0:
            log.info("huge pages refused for receive outputs (madvise errno %d); using ordinary pages",
                     ctypes.get_errno())
            self._madvise = None  # the kernel has no THP (EINVAL): do not ask again on every receive
            return None
        offset = start - base
        return block[offset:offset + nbytes]


_ADVISOR = _HugePageAdvisor()


def huge_page_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uninitialised CPU memory (a contiguous uint8 tensor): on huge pages where the OS
    grants them (a view starting on a huge-page boundary), else ordinary."""
    raw = _ADVISOR.tensor(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8) if raw is None else raw


def empty_output(layout: Layout, num_tokens: int, device: torch.device, *,
                 large: Callable[[int], torch.Tensor] = huge_page_memory,
                 min_bytes: int = HUGE_PAGE_MIN_BYTES) -> dict[str, torch.Tensor]:
    """Uninitialised tensors for ``num_tokens`` tokens of every field of ``layout`` on ``device``: a
    CPU field of at least ``min_bytes`` from ``large(nbytes)`` (a contiguous uint8 tensor; by default
    on huge pages, see the module docstring), the rest as :meth:`Layout.empty` makes them. Each tensor
    is contiguous; with the default ``large``, a huge-page one is a view into a slightly larger
    allocation (its ``storage_offset`` is not 0), freed with the tensor
    (:class:`~aioembed.memory.output_cache.OutputCache` passes its own, which lends kept memory, and a
    smaller ``min_bytes``)."""
    if device.type != "cpu":
        return layout.empty(num_tokens, device=device)
    out: dict[str, torch.Tensor] = {}
    for name, f in layout.items():
        shape = (num_tokens, *f.shape)
        nbytes = num_tokens * f.row_bytes
        out[name] = (large(nbytes).view(f.dtype).view(shape) if nbytes >= min_bytes
                     else torch.empty(shape, dtype=f.dtype))
    return out
