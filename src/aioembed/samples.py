"""The reference row layout and reproducible sample requests, for demos, benchmarks and tests.

Kept out of :mod:`aioembed.testing` (which needs pytest) so that ``aioembed demo`` and
``aioembed bench`` run on a plain install.
"""

from __future__ import annotations

import ctypes
import hashlib
import zlib
from collections.abc import Mapping, Sequence

import torch

from aioembed.layout import Field, Layout, bytes_are_values, plain_values

__all__ = ["checksum", "deterministic_request", "same_rows", "standard_layout"]

_memcmp = ctypes.CDLL(None).memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def standard_layout(hidden: int = 3584) -> Layout:
    """An embedding of ``hidden`` bf16 values, an int32 token id and a 3-D int64 mrope position."""
    return Layout(
        embeddings=Field((hidden,), torch.bfloat16),
        token_ids=Field((), torch.int32),
        mrope_positions=Field((3,), torch.int64),
    )


def deterministic_request(layout: Layout, num_tokens: int, room: int | str) -> dict[str, torch.Tensor]:
    """Rows derived from ``room`` alone: the same in every process."""
    seed = zlib.crc32(repr(room).encode()) ^ num_tokens
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, f in layout.items():
        raw = torch.randint(0, 256, (num_tokens * f.row_bytes,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(f.dtype).reshape(num_tokens, *f.shape)
    return out


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over every field's bytes, fields in name order: equal hashes, equal rows."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        # (A conjugate or negative view holds other bytes than its values: resolved, its values are hashed.)
        t = plain_values(tensors[name].detach().cpu())
        h.update(name.encode())
        nbytes = t.numel() * t.element_size()
        if nbytes:
            h.update((ctypes.c_char * nbytes).from_address(t.data_ptr()))
    return h.hexdigest()


def same_rows(got: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], want: Mapping[str, torch.Tensor]) -> bool:
    """True if every field of ``want`` has the same rows (dtype and bytes) in ``got``, where a field of
    ``got`` is one tensor or its pieces in row order (a :class:`~aioembed.Lease`'s ``views``), on any
    device (rows on different devices are compared on the GPU that holds one of them).

    CPU tensors are compared with ``memcmp`` on the calling thread: ``torch.equal`` (or a ``torch.cat``
    of the pieces) hands a few hundred KB to torch's intra-op threads, whose spin-waiting afterwards
    steals the cores of a small host from everything else (a benchmark that checks its rows must not
    slow what it measures)."""
    for name, w in want.items():
        g = got[name]
        pieces = [g] if isinstance(g, torch.Tensor) else list(g)
        if sum(p.shape[0] for p in pieces) != w.shape[0]:
            return False
        at = 0
        for p in pieces:
            part = w[at:at + p.shape[0]]
            at += p.shape[0]
            if p.dtype != part.dtype or tuple(p.shape[1:]) != tuple(part.shape[1:]):
                return False
            if (p.device.type == "cpu" and part.device.type == "cpu" and p.is_contiguous() and part.is_contiguous()
                    and bytes_are_values(p) and bytes_are_values(part)):
                nbytes = part.numel() * part.element_size()
                if nbytes and _memcmp(p.data_ptr(), part.data_ptr(), nbytes) != 0:
                    return False
            else:
                # A conjugate or negative view's memory holds other bytes than its values (and torch refuses a
                # byte view of it): its values are compared, resolved.
                on = p.device if p.device.type == "cuda" else part.device  # compare on the GPU when one holds rows
                a, b = (plain_values(t).view(torch.uint8).to(on) for t in (p, part))
                if not torch.equal(a, b):
                    return False
    return True
