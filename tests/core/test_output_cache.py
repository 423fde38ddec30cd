"""OutputCache: large fields of fresh outputs reuse the memory of dropped outputs, never of held ones."""

from __future__ import annotations

import gc
import queue
import threading

import pytest
import torch

from aioembed import Field, Layout
from aioembed.memory.output import HUGE_PAGE_BYTES, HUGE_PAGE_MIN_BYTES
from aioembed.memory.output_cache import OutputCache

LAYOUT = Layout(
    embeddings=Field((4096,), torch.bfloat16),  # 8 KiB a row: 1024 rows make the 8 MiB threshold
    token_ids=Field((), torch.int32),
)
ROW = LAYOUT["embeddings"].row_bytes
BIG = HUGE_PAGE_MIN_BYTES // ROW  # tokens whose embeddings field is exactly the threshold
CPU = torch.device("cpu")


def _span(tokens: int) -> int:
    """Bytes of the span that holds ``tokens`` rows of embeddings."""
    return -(-tokens * ROW // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES


def test_a_dropped_output_lends_its_memory_to_the_next_and_a_held_one_never() -> None:
    cache = OutputCache(64 << 20)
    first = cache.empty(LAYOUT, BIG, CPU)
    ptr = first["embeddings"].data_ptr()
    held = cache.empty(LAYOUT, BIG, CPU)  # first is still held: new memory
    assert held["embeddings"].data_ptr() != ptr
    assert (cache.stats.hits, cache.stats.misses, cache.stats.lent) == (0, 2, 2)
    del first
    assert (cache.stats.lent, cache.stats.idle_bytes) == (1, _span(BIG))
    again = cache.empty(LAYOUT, BIG, CPU)
    assert again["embeddings"].data_ptr() == ptr
    assert (cache.stats.hits, cache.stats.idle_bytes, cache.stats.lent) == (1, 0, 2)
    # Small fields are ordinary allocations, never kept here.
    assert again["token_ids"].untyped_storage().nbytes() == again["token_ids"].nbytes


def test_outputs_have_the_layout_shape_dtype_and_hold_what_is_written() -> None:
    cache = OutputCache(64 << 20)
    tokens = BIG + 100
    out = cache.empty(LAYOUT, tokens, CPU)
    for name, f in LAYOUT.items():
        t = out[name]
        assert t.shape == (tokens, *f.shape) and t.dtype == f.dtype and t.is_contiguous(), name
    big = out["embeddings"]
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0
    assert big.untyped_storage().nbytes() == big.nbytes  # the caller sees exactly its field
    src = torch.randn(tokens, 4096).to(torch.bfloat16)
    big.copy_(src)
    assert torch.equal(big, src)
    del out, big
    reused = cache.empty(LAYOUT, tokens, CPU)["embeddings"]
    assert cache.stats.hits == 1
    reused.copy_(src.flip(0))
    assert torch.equal(reused, src.flip(0))


def test_a_view_of_a_dropped_output_keeps_its_memory_lent() -> None:
    cache = OutputCache(64 << 20)
    out = cache.empty(LAYOUT, BIG, CPU)
    row = out["embeddings"][7]
    row.fill_(3)
    ptr = out["embeddings"].data_ptr()
    del out
    assert cache.stats.lent == 1 and cache.stats.idle_bytes == 0
    other = cache.empty(LAYOUT, BIG, CPU)["embeddings"]
    assert other.data_ptr() != ptr
    other.fill_(5)
    assert bool((row == 3).all())  # the view still reads its own rows
    del row
    assert cache.empty(LAYOUT, BIG, CPU)["embeddings"].data_ptr() == ptr


def test_idle_memory_is_bounded_oldest_first_and_oversized_spans_are_not_kept() -> None:
    span = _span(BIG)
    cache = OutputCache(2 * span)
    a, b, c = (cache.empty(LAYOUT, BIG, CPU)["embeddings"] for _ in range(3))
    ptrs = [t.data_ptr() for t in (a, b, c)]
    del a, b, c  # a goes back first: the oldest idle span, freed when c comes back
    assert cache.stats.idle_bytes == 2 * span and cache.stats.freed == 1
    assert cache.empty(LAYOUT, BIG, CPU)["embeddings"].data_ptr() in ptrs[1:]
    huge = cache.empty(LAYOUT, 3 * BIG, CPU)  # its span exceeds the capacity
    freed = cache.stats.freed
    del huge
    assert cache.stats.freed == freed + 1 and cache.stats.idle_bytes <= 2 * span


def test_a_much_larger_idle_span_is_not_lent_for_a_small_field() -> None:
    cache = OutputCache(256 << 20)
    large = cache.empty(LAYOUT, 4 * BIG, CPU)
    del large
    small = cache.empty(LAYOUT, BIG, CPU)
    assert (cache.stats.hits, cache.stats.misses) == (0, 2)
    assert cache.stats.idle_bytes == _span(4 * BIG)
    del small


def test_capacity_zero_keeps_nothing() -> None:
    cache = OutputCache(0)
    out = cache.empty(LAYOUT, BIG, CPU)
    assert out["embeddings"].data_ptr() % HUGE_PAGE_BYTES == 0  # still on huge pages where granted
    del out
    assert cache.stats == type(cache.stats)()


def test_outputs_dropped_on_other_threads_come_back_and_none_is_lent_twice() -> None:
    cache = OutputCache(128 << 20)
    handed: queue.Queue[dict[str, torch.Tensor] | None] = queue.Queue()
    live: set[int] = set()
    lock = threading.Lock()

    def dropper() -> None:
        while (item := handed.get()) is not None:
            with lock:
                live.discard(item["embeddings"].data_ptr())
            del item  # the finalizer runs on this thread

    threads = [threading.Thread(target=dropper) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(300):
            out = cache.empty(LAYOUT, BIG + (i % 3) * 1024, CPU)
            out["embeddings"].view(torch.uint8)[:8].fill_(i % 251)
            with lock:
                assert out["embeddings"].data_ptr() not in live, "memory lent twice"
                live.add(out["embeddings"].data_ptr())
            handed.put(out)
            del out
    finally:
        for _ in threads:
            handed.put(None)
        for t in threads:
            t.join()
    gc.collect()
    cache._settle()
    assert cache.stats.lent == 0
    assert cache.stats.hits > 0
    assert cache.stats.idle_bytes == sum(s.nbytes for s in cache._idle) <= cache.capacity


def test_a_return_during_the_cache_own_critical_section_is_settled_after_it() -> None:
    cache = OutputCache(64 << 20)
    out = cache.empty(LAYOUT, BIG, CPU)
    with cache._lock:  # as when a garbage collection inside the cache drops an output
        del out
        assert cache.stats.lent == 1 and len(cache._returned) == 1
    cache._settle()
    assert cache.stats.lent == 0 and cache.stats.idle_bytes == _span(BIG)


def test_close_frees_idle_memory_and_what_comes_back_later() -> None:
    cache = OutputCache(64 << 20)
    a = cache.empty(LAYOUT, BIG, CPU)
    b = cache.empty(LAYOUT, BIG, CPU)
    del a
    assert cache.stats.idle_bytes == _span(BIG)
    cache.close()
    assert cache.stats.idle_bytes == 0 and cache.stats.freed == 1
    del b
    assert cache.stats.idle_bytes == 0 and cache.stats.freed == 2 and cache.stats.lent == 0
    after = cache.empty(LAYOUT, BIG, CPU)  # still makes outputs, as plain fresh memory
    del after
    assert cache.stats.lent == 0 and cache.stats.idle_bytes == 0
    cache.close()


@pytest.mark.parametrize("bad", [-1, 1 << 41, 1.5])
def test_the_setting_is_checked(bad: object) -> None:
    from aioembed import TransferConfig
    from aioembed.errors import ConfigError

    with pytest.raises(ConfigError, match="output_cache_bytes"):
        TransferConfig(output_cache_bytes=bad)  # type: ignore[arg-type]


def test_a_failed_allocation_leaves_the_counts_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioembed.memory import output_cache

    cache = OutputCache(64 << 20)

    def no_memory(nbytes: int) -> torch.Tensor:
        raise MemoryError(f"no {nbytes} bytes")

    monkeypatch.setattr(output_cache, "huge_page_memory", no_memory)
    with pytest.raises(MemoryError):
        cache.empty(LAYOUT, BIG, CPU)
    assert (cache.stats.lent, cache.stats.idle_bytes) == (0, 0)
