"""Fresh output tensors for a copying ``receive()``, backed by huge pages where the OS allows.

A copying receive writes every byte of a freshly allocated output once. With 4 KiB pages the first
touch of each page is a fault (zeroing the page and mapping it), and for an 8192-token request of the
standard layout (59 MB) those faults took longer than the copy itself: 22 ms against 4.6 ms into
memory already touched, on the 2-core development machine. Transparent huge pages fault 2 MiB at a
time, 512 times fewer: the same fresh copy took 6.1 ms.

How the memory is asked for, and where the OS refuses: :mod:`aioembed.memory.huge_pages`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from aioembed.layout import Layout
from aioembed.memory.huge_pages import HUGE_PAGE_MIN_BYTES, huge_page_memory

__all__ = ["empty_output", "is_out_of_memory"]


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
        out[name] = (f.rows_over(large(nbytes), num_tokens) if nbytes >= min_bytes
                     else torch.empty(shape, dtype=f.dtype))
    return out


def is_out_of_memory(exc: BaseException) -> bool:
    """``exc`` is an allocator refusing memory: torch's CUDA ``OutOfMemoryError``, its CPU allocator's
    ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory", errno 12), or Python's ``MemoryError``. Such a
    failure is the machine's state, not a bug: the caller reports it as such (no "internal error" traceback)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
