"""The reference row layout and reproducible sample requests, for demos, benchmarks and tests.

Kept out of :mod:`aioembed.testing` (which needs pytest) so that ``aioembed demo`` and
``aioembed bench`` run on a plain install.
"""

from __future__ import annotations

import ctypes
import hashlib
import zlib
from collections.abc import Mapping

import torch

from aioembed.layout import Field, Layout

__all__ = ["checksum", "deterministic_request", "standard_layout"]


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
        t = tensors[name].detach().cpu().contiguous()
        h.update(name.encode())
        nbytes = t.numel() * t.element_size()
        if nbytes:
            h.update((ctypes.c_char * nbytes).from_address(t.data_ptr()))
    return h.hexdigest()
