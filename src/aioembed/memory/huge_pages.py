"""CPU memory on transparent huge pages, for the large tensors aioembed allocates itself.

Two places gain, both measured on the 2-core development machine:

* a copying ``receive()``'s fresh output (:mod:`aioembed.memory.output`): the first touch of each
  4 KiB page is a fault, and for 59 MB those faults took longer than the copy itself;
* the receive pool (:class:`~aioembed.memory.pool.BlockPool`): a transport that writes through the
  kernel (NIXL's UCX over shared memory uses ``process_vm_writev``) pins and walks the destination's
  pages on every write. An 8192-token write (59 MB, raw NIXL, two processes) into huge pages took
  4.7-5.3 ms against 7.4-7.9 ms into ordinary pages. Over TCP (Mooncake, UCX) the difference was within the noise.

Linux grants huge pages to anonymous memory that asks for them (``madvise(MADV_HUGEPAGE)``) when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (the common default) or ``always``.
So a large tensor is allocated with 2 MiB of slack, its start aligned to 2 MiB inside that block,
and the range advised before anything touches it. The slack is address space, not memory: pages
never touched are never backed. Where the advice is refused (no THP in the kernel, not Linux) the
memory is allocated anew, with ordinary pages.

The price is paid once, when the memory is first written: the kernel may compact memory to find free
huge pages. Zeroing a 470 MiB pool took 117-584 ms here against 89-140 ms on ordinary pages (both
commit every page at once, as ``torch.zeros`` does).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from typing import Any

import torch

__all__ = ["HUGE_PAGE_BYTES", "HUGE_PAGE_MIN_BYTES", "huge_page_memory", "zeroed_memory"]

log = logging.getLogger("aioembed.memory.huge_pages")

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
            log.info("huge pages refused (madvise errno %d); using ordinary pages",
                     ctypes.get_errno())
            self._madvise = None  # the kernel has no THP (EINVAL): do not ask again for each allocation
            return None
        offset = start - base
        return block[offset:offset + nbytes]


_ADVISOR = _HugePageAdvisor()


def huge_page_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uninitialised CPU memory (a contiguous uint8 tensor): on huge pages where the OS
    grants them (a view starting on a huge-page boundary), else ordinary."""
    raw = _ADVISOR.tensor(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8) if raw is None else raw


def zeroed_memory(nbytes: int, *, min_bytes: int = HUGE_PAGE_MIN_BYTES) -> torch.Tensor:
    """``nbytes`` of zeroed CPU memory (a contiguous uint8 tensor), on huge pages from ``min_bytes`` up.

    How the receive pool allocates a CPU field; ``aioembed bench``'s raw baselines allocate their
    destinations with it too, so that both sides of a comparison write into the same kind of memory."""
    if nbytes >= min_bytes:
        return huge_page_memory(nbytes).zero_()
    return torch.zeros(nbytes, dtype=torch.uint8)
