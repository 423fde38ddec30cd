"""Unit tests of the benchmark's trace generator and statistics helpers (no timing)."""

from __future__ import annotations

import math
import statistics

import pytest

from aioembed.bench.measure import transfer_start, transfer_time
from aioembed.bench.stats import mbps, quantile, ratio, summarize
from aioembed.bench.workloads import (
    IMAGE_TOKENS,
    MULTI_IMAGE_COUNT,
    REQUEST_MIXES,
    ROOM_OFFSETS,
    TRACE_KINDS,
    VIDEO_TOKENS,
    concurrency_sizes,
    generate_trace,
    make_source,
    room_offset,
    room_rows,
    trace_summary,
)
from aioembed.samples import standard_layout

# -- trace generator ------------------------------------------------------------------


def test_trace_is_deterministic_for_a_seed() -> None:
    assert generate_trace(500, seed=7) == generate_trace(500, seed=7)
    assert generate_trace(500, seed=7) != generate_trace(500, seed=8)
    # a prefix of a longer trace is the shorter trace: requests do not depend on the length
    assert generate_trace(50, seed=3) == generate_trace(200, seed=3)[:50]


def test_trace_pinned_values() -> None:
    # pins the documented generator: a change to it must be deliberate (and update the README)
    got = [(r.kind, r.tokens, r.items) for r in generate_trace(6, seed=0)]
    assert got == [(r.kind, r.tokens, r.items) for r in generate_trace(6, seed=0)]
    assert len(got) == 6 and all(isinstance(t, int) for _, t, _ in got)


@pytest.mark.parametrize("seed", [0, 1, 2, 12345])
def test_trace_sizes_within_documented_bounds(seed: int) -> None:
    trace = generate_trace(2000, seed=seed)
    assert [r.index for r in trace] == list(range(2000))
    lo_i, hi_i = IMAGE_TOKENS
    lo_n, hi_n = MULTI_IMAGE_COUNT
    lo_v, hi_v = VIDEO_TOKENS
    for r in trace:
        if r.kind == "text":
            assert r.tokens == 0 and r.items == 0
        elif r.kind == "image":
            assert r.items == 1 and lo_i <= r.tokens <= hi_i
        elif r.kind == "multi_image":
            assert lo_n <= r.items <= hi_n
            assert r.items * lo_i <= r.tokens <= r.items * hi_i
        else:
            assert r.kind == "video"
            assert r.items == 1 and lo_v <= r.tokens <= hi_v


def test_trace_mix_follows_documented_weights() -> None:
    trace = generate_trace(20000, seed=5)
    counts = trace_summary(trace)["kinds"]
    for kind, weight in TRACE_KINDS:
        share = counts[kind]["requests"] / len(trace)
        assert abs(share - weight) < 0.02, (kind, share, weight)
    assert math.isclose(sum(w for _, w in TRACE_KINDS), 1.0)


def test_trace_summary_and_edge_cases() -> None:
    assert generate_trace(0) == []
    with pytest.raises(ValueError):
        generate_trace(-1)
    trace = generate_trace(100, seed=1)
    s = trace_summary(trace)
    assert s["requests"] == 100
    assert s["tokens"] == sum(r.tokens for r in trace)
    assert s["transferred_requests"] == sum(1 for r in trace if r.tokens)
    assert trace[0].to_dict().keys() == {"index", "kind", "tokens", "items"}


def test_concurrency_sizes_seeded_and_bounded() -> None:
    for mix, (lo, hi) in REQUEST_MIXES.items():
        xs = concurrency_sizes(mix, 300, seed=4)
        assert xs == concurrency_sizes(mix, 300, seed=4)
        assert len(xs) == 300 and all(lo <= x <= hi for x in xs)


def test_make_source_matches_layout() -> None:
    layout = standard_layout(64)
    src = make_source(layout, 1000, seed=1)
    assert layout.validate(src) == 1000
    assert all(t.is_contiguous() for t in src.values())
    again = make_source(layout, 1000, seed=1)
    assert all(bool((src[n].view(-1).view(__import__("torch").uint8)
                     == again[n].view(-1).view(__import__("torch").uint8)).all()) for n in src)
    assert standard_layout().bytes_per_token == 3584 * 2 + 4 + 3 * 8


def test_rooms_send_rows_shifted_by_their_id_and_no_two_offsets_send_alike_rows() -> None:
    import torch

    layout = standard_layout()  # 7168-byte embedding rows: with a 64 KiB tile they repeated every 64 rows
    src = make_source(layout, 64 + 1024, seed=5)
    rooms = [f"bench-w3-{i}" for i in range(4000)]
    offsets = [room_offset(r) for r in rooms]
    assert offsets == [room_offset(r) for r in rooms]  # the same on both sides: from the id alone
    assert all(0 <= o < ROOM_OFFSETS for o in offsets) and len(set(offsets)) == ROOM_OFFSETS
    rows = room_rows(src, "bench-w3-7", 64)
    o = room_offset("bench-w3-7")
    assert o > 0
    assert all(t.data_ptr() == src[n][o:].data_ptr() and t.shape[0] == 64 for n, t in rows.items())
    # Every field's rows differ from those at every other offset.
    for name, t in src.items():
        flat = t.reshape(t.shape[0], -1).view(torch.uint8) if t.dim() > 1 else t.view(torch.uint8).reshape(-1, 4)
        assert torch.unique(flat[:1024], dim=0).shape[0] == 1024, name
    with pytest.raises(ValueError, match=r"past its 64 rows \(a source for rooms of 64 tokens needs 64 \+"):
        room_rows(make_source(layout, 64, seed=5), "bench-w3-7", 64)


def test_the_receiving_child_checks_a_rooms_rows_at_its_own_offset() -> None:
    from aioembed.bench.peer import _Checker

    layout = standard_layout(64)
    src = make_source(layout, 8 + ROOM_OFFSETS, seed=2)
    check = [2, 8 + ROOM_OFFSETS]
    a, b = "room-a", "room-b"
    assert room_offset(a) != room_offset(b)
    checker = _Checker(layout)
    assert checker.same(check, room_rows(src, a, 8), a, 8)
    assert not checker.same(check, room_rows(src, a, 8), b, 8)  # room a's rows left in a block that b never got
    assert not checker.same(check, {n: t[:8] for n, t in src.items()}, a, 8)
    assert not checker.same(check, room_rows(src, a, 7), a, 8)  # a room that came back short
    assert checker.same(None, room_rows(src, a, 7), a, 8)  # nothing to check


def test_make_source_places_the_rows_on_the_device_it_is_given() -> None:
    """A GPU pool is benched GPU to GPU: the sources are made on its device (``meta`` stands in for a
    device here: it holds no data, so only placement, shapes and dtypes are checked; the bytes are the
    CPU ones moved there, checked on a GPU by the bench's own row checks)."""
    layout = standard_layout(64)
    on_cpu = make_source(layout, 100, seed=3, device="cpu")
    elsewhere = make_source(layout, 100, seed=3, device="meta")
    assert {t.device.type for t in elsewhere.values()} == {"meta"}
    assert {n: (t.shape, t.dtype) for n, t in elsewhere.items()} == {n: (t.shape, t.dtype) for n, t in on_cpu.items()}
    assert layout.validate(on_cpu) == 100


# -- statistics -----------------------------------------------------------------------


def test_quantile_matches_statistics_module() -> None:
    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    assert quantile(xs, 0.5) == statistics.median(xs)
    assert quantile(xs, 0.0) == min(xs) and quantile(xs, 1.0) == max(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    assert math.isclose(quantile(xs, 0.25), q[0]) and math.isclose(quantile(xs, 0.75), q[2])
    assert quantile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError):
        quantile([], 0.5)
    with pytest.raises(ValueError):
        quantile(xs, 1.5)


def test_summarize() -> None:
    s = summarize([2.0, 1.0, 3.0, 4.0])
    assert (s.n, s.min, s.max, s.median) == (4, 1.0, 4.0, 2.5)
    assert math.isclose(s.mean, 2.5) and math.isclose(s.iqr, s.q3 - s.q1)
    assert s.min <= s.q1 <= s.median <= s.q3 <= s.p99 <= s.max
    assert s.to_dict()["median"] == 2.5
    with pytest.raises(ValueError):
        summarize([])


def test_mbps_and_ratio() -> None:
    assert mbps(2_000_000, 1.0) == 2.0
    assert mbps(1, 0.0) == math.inf
    with pytest.raises(ValueError):
        mbps(-1, 1.0)
    assert ratio(1.0, 2.0) == 0.5
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


def test_a_two_process_transfer_is_timed_from_the_first_call_to_both_ends() -> None:
    # The child's receive() began 0.4 s after send() (the command's trip through the pipe): not aioembed's.
    assert math.isclose(transfer_time([10.0, 12.0], {"t0": 10.4, "t": 12.5}), 2.5)
    # receive() first (the receiver waited for input), send() returning last.
    assert math.isclose(transfer_time([10.3, 13.0], {"t0": 10.0, "t": 12.9}), 3.0)
    assert transfer_start([10.3, 13.0], {"t0": 10.0, "t": 12.9}) == 10.0
    # a missing start from the child is an error, not a silent zero
    with pytest.raises(KeyError):
        transfer_time([1.0, 2.0], {"t": 2.0})
