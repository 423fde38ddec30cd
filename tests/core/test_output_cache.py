"""OutputCache: fields of fresh outputs reuse the memory of dropped outputs, never of held ones."""

from __future__ import annotations

import gc
import queue
import threading

import pytest
import torch

from aioembed import Field, Layout
from aioembed.memory.huge_pages import HUGE_PAGE_BYTES, HUGE_PAGE_MIN_BYTES
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


@pytest.mark.parametrize(("base", "step"), [(BIG, 1024), (40, 8)], ids=["large", "small"])
def test_outputs_dropped_on_other_threads_come_back_and_none_is_lent_twice(base: int, step: int) -> None:
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
            out = cache.empty(LAYOUT, base + (i % 3) * step, CPU)
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
    assert cache.stats.idle_bytes <= cache.capacity
    _consistent(cache)


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


def test_a_small_field_is_lent_from_a_power_of_two_span_and_reused_once_dropped() -> None:
    from aioembed.memory.output_cache import SPAN_MIN_BYTES, span_bytes

    cache = OutputCache(64 << 20)
    tokens = 57  # 456 KiB of embeddings: a 512 KiB span; token ids (228 bytes) stay ordinary
    assert span_bytes(tokens * ROW) == 512 << 10 and tokens * 4 < SPAN_MIN_BYTES
    out = cache.empty(LAYOUT, tokens, CPU)
    emb = out["embeddings"]
    assert emb.shape == (tokens, 4096) and emb.dtype == torch.bfloat16 and emb.is_contiguous()
    assert emb.untyped_storage().nbytes() == emb.nbytes  # the caller sees exactly its field
    src = torch.randn(tokens, 4096).to(torch.bfloat16)
    emb.copy_(src)
    assert torch.equal(emb, src)
    ptr = emb.data_ptr()
    held = cache.empty(LAYOUT, tokens, CPU)["embeddings"]  # the first is still held: new memory
    assert held.data_ptr() != ptr
    held.fill_(7)
    assert (cache.stats.misses, cache.stats.lent) == (2, 2)
    del out, emb
    assert (cache.stats.lent, cache.stats.idle_bytes) == (1, 512 << 10)
    smaller = cache.empty(LAYOUT, 40, CPU)["embeddings"]  # 320 KiB: its 512 KiB class, the same span
    assert smaller.data_ptr() == ptr and cache.stats.hits == 1
    smaller.copy_(src[:40].flip(0))
    assert torch.equal(smaller, src[:40].flip(0)) and bool((held == 7).all())
    del smaller
    tiny = cache.empty(LAYOUT, 16, CPU)  # 128 KiB: a span of up to 256 KiB only, not the idle 512 KiB
    assert tiny["embeddings"].data_ptr() != ptr and cache.stats.misses == 3
    below = cache.empty(LAYOUT, 7, CPU)["embeddings"]  # 56 KiB: below the threshold, not counted
    assert below.untyped_storage().nbytes() == below.nbytes and cache.stats.misses == 3


def _consistent(cache: OutputCache) -> None:
    """The idle spans by age and by size are the same spans, and add up to the idle bytes."""
    by_size = [span for spans in cache._by_size.values() for span in spans]
    assert sorted(map(id, by_size)) == sorted(map(id, cache._idle))
    assert sum(span.nbytes for span in cache._idle) == cache.stats.idle_bytes


def test_span_sizes_are_few_and_at_most_twice_the_field() -> None:
    from aioembed.memory.output_cache import span_bytes

    kib, mib = 1 << 10, 1 << 20
    assert [span_bytes(n) for n in (64 * kib, 64 * kib + 1, 458 * kib, 4 * mib)] == [64 * kib, 128 * kib,
                                                                                     512 * kib, 4 * mib]
    assert [span_bytes(n) for n in (4 * mib + 1, 5 * mib, 8 * mib, 8 * mib + 1)] == [6 * mib, 6 * mib,
                                                                                     8 * mib, 10 * mib]
    # Reuse is bounded by the field, not by its new span: a 65 KiB field (a new span would be 128 KiB)
    # is not lent an idle 256 KiB span.
    cache = OutputCache(64 << 20)
    wide = cache.empty(LAYOUT, 32, CPU)  # 256 KiB
    del wide
    narrow = cache.empty(Layout(x=Field((65 * kib,), torch.uint8)), 1, CPU)["x"]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.idle_bytes) == (0, 2, 256 * kib)
    del narrow
    _consistent(cache)


def test_idle_spans_are_found_by_size_and_evicted_oldest_first() -> None:
    cache = OutputCache(256 << 10)
    a, b, c, d = (cache.empty(LAYOUT, 8, CPU)["embeddings"] for _ in range(4))  # 64 KiB each
    ptrs = {name: t.data_ptr() for name, t in zip("abcd", (a, b, c, d), strict=True)}
    del a, b, c, d  # given back in this order: 256 KiB idle, the bound
    _consistent(cache)
    e = cache.empty(LAYOUT, 16, CPU)["embeddings"]  # 128 KiB: no idle span of that size (64 KiB is too small)
    assert cache.stats.misses == 5
    ptrs["e"] = e.data_ptr()
    del e  # 384 KiB idle: the two oldest (a, b) go
    assert (cache.stats.idle_bytes, cache.stats.freed) == (256 << 10, 2)
    _consistent(cache)
    first, second = (cache.empty(LAYOUT, 8, CPU)["embeddings"] for _ in range(2))
    assert (first.data_ptr(), second.data_ptr()) == (ptrs["d"], ptrs["c"])  # last given back first
    assert cache.stats.hits == 2
    third = cache.empty(LAYOUT, 8, CPU)["embeddings"]  # a and b are gone: e's span, exactly twice the field
    assert third.data_ptr() == ptrs["e"] and (cache.stats.hits, cache.stats.misses) == (3, 5)
    fourth = cache.empty(LAYOUT, 8, CPU)["embeddings"]  # nothing idle is left
    assert cache.stats.misses == 6 and cache.stats.idle_bytes == 0
    _consistent(cache)
    del first, second, third, fourth
