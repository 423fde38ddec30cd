"""The receive pool's CPU memory: large fields zeroed on huge pages, small ones as ``torch.zeros`` makes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioembed import Field, Layout
from aioembed.memory.huge_pages import HUGE_PAGE_BYTES, HUGE_PAGE_MIN_BYTES, zeroed_memory
from aioembed.memory.pool import BlockPool

LAYOUT = Layout(
    embeddings=Field((4096,), torch.bfloat16),  # 8 KiB a row: 1024 rows make the 8 MiB threshold
    token_ids=Field((), torch.int32),
    mrope_positions=Field((3,), torch.int64),
)
BLOCK = 128
BIG_BLOCKS = HUGE_PAGE_MIN_BYTES // LAYOUT["embeddings"].row_bytes // BLOCK  # embeddings exactly at the threshold


def _dirty_then_free(nbytes: int) -> None:
    """Leave nonzero bytes in memory the allocator may hand out next, so that zeros seen later were written."""
    junk = torch.full((nbytes,), 0x5A, dtype=torch.uint8)
    del junk


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="this kernel has no transparent huge pages (not Linux, or built without them)")
def test_a_large_field_starts_on_a_huge_page_and_small_ones_are_plain() -> None:
    pool = BlockPool(LAYOUT, num_blocks=BIG_BLOCKS, block_size=BLOCK)
    big = pool.tensors["embeddings"]
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0
    for name in ("token_ids", "mrope_positions"):  # 4 / 24 bytes a row: far under the threshold
        assert pool.tensors[name].storage_offset() == 0
        assert pool.tensors[name].untyped_storage().nbytes() == pool.tensors[name].nbytes
    smaller = BlockPool(LAYOUT, num_blocks=BIG_BLOCKS - 1, block_size=BLOCK).tensors["embeddings"]
    assert smaller.storage_offset() == 0 and smaller.untyped_storage().nbytes() == smaller.nbytes


@pytest.mark.parametrize("blocks", [BIG_BLOCKS, BIG_BLOCKS - 1, 1])
def test_fields_are_zeroed_have_the_layout_shape_and_do_not_overlap(blocks: int) -> None:
    _dirty_then_free(blocks * BLOCK * LAYOUT["embeddings"].row_bytes + 2 * HUGE_PAGE_BYTES)
    pool = BlockPool(LAYOUT, num_blocks=blocks, block_size=BLOCK)
    rows = blocks * BLOCK
    assert pool.nbytes == rows * LAYOUT.bytes_per_token
    for name, f in LAYOUT.items():
        t = pool.tensors[name]
        assert t.shape == (rows, *f.shape) and t.dtype == f.dtype and t.is_contiguous(), name
        assert not bool(t.view(torch.uint8).any()), f"{name}: the pool starts zeroed"
    for i, name in enumerate(LAYOUT):
        pool.tensors[name].view(torch.uint8).fill_(i + 1)
    for i, name in enumerate(LAYOUT):
        assert bool((pool.tensors[name].view(torch.uint8) == i + 1).all()), name
    regions = pool.regions()
    assert [(r.address, r.length) for r in regions] == [(t.data_ptr(), t.nbytes) for t in pool.tensors.values()]


def test_refused_advice_gives_zeroed_ordinary_memory(refused_huge_pages: list[int]) -> None:
    for _ in range(2):
        _dirty_then_free(HUGE_PAGE_MIN_BYTES + HUGE_PAGE_BYTES)
        big = BlockPool(LAYOUT, num_blocks=BIG_BLOCKS, block_size=BLOCK).tensors["embeddings"]
        assert big.storage_offset() == 0 and not bool(big.view(torch.uint8).any())
    assert len(refused_huge_pages) == 1  # refused once, not asked again


def test_zeroed_memory_below_and_from_the_threshold() -> None:
    for nbytes in (1, HUGE_PAGE_MIN_BYTES - 1, HUGE_PAGE_MIN_BYTES, HUGE_PAGE_MIN_BYTES + 1):
        _dirty_then_free(nbytes + HUGE_PAGE_BYTES)
        t = zeroed_memory(nbytes)
        assert t.dtype == torch.uint8 and t.shape == (nbytes,) and t.is_contiguous()
        assert not bool(t.any()), nbytes
