"""Raw baselines write into memory at least as fast as the receive pool's: huge pages at any size."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from aioembed import Field, Layout, TransferConfig
from aioembed.bench.baselines import LoopbackBaseline, destination_memory
from aioembed.memory.huge_pages import HUGE_PAGE_BYTES, HUGE_PAGE_MIN_BYTES
from aioembed.memory.pool import BlockPool

LAYOUT = Layout(embeddings=Field((4096,), torch.bfloat16), token_ids=Field((), torch.int32))

pytestmark = pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                                reason="this kernel has no transparent huge pages (not Linux, or built without them)")


def test_a_raw_destination_under_the_pool_threshold_still_asks_for_huge_pages() -> None:
    small = destination_memory(HUGE_PAGE_MIN_BYTES // 8)
    assert small.data_ptr() % HUGE_PAGE_BYTES == 0 and not bool(small.any())


def test_the_loopback_baseline_faces_a_huge_page_pool_with_huge_pages() -> None:
    # 256 tokens of raw destination (2 MiB of embeddings) against a 1024-token pool (8 MiB: huge pages).
    pool = BlockPool(LAYOUT, num_blocks=8, block_size=128)
    assert pool.tensors["embeddings"].data_ptr() % HUGE_PAGE_BYTES == 0
    src = {name: torch.ones((256, *f.shape), dtype=f.dtype) for name, f in LAYOUT.items()}
    baseline = LoopbackBaseline(LAYOUT, TransferConfig())

    async def run() -> None:
        await baseline.setup(src, 256)
        await baseline.transfer("memmove", 256)

    anyio.run(run)
    dst = baseline._dst["embeddings"]
    assert dst.data_ptr() % HUGE_PAGE_BYTES == 0
    assert torch.equal(dst, src["embeddings"])
