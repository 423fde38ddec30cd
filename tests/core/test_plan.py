"""Write planning and the block pool, checked by moving real bytes and comparing them."""

from __future__ import annotations

import ctypes
import itertools
import random
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioembed import BlockPool, Field, Layout, LayoutError, PlanError
from aioembed.memory.plan import FieldSpan, RowRun, plan_row_runs, plan_writes
from aioembed.transports.base import WriteOp

LAYOUT = Layout(
    embeddings=Field((64,), torch.bfloat16),
    token_ids=Field((), torch.int32),
    mrope_positions=Field((3,), torch.int64),
)
SENTINEL = 0xA5


def random_rows(num_tokens: int, seed: int, layout: Layout = LAYOUT) -> dict[str, torch.Tensor]:
    """Random bit patterns for every field (NaNs included: compared as bytes)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, f in layout.items():
        raw = torch.randint(0, 256, (num_tokens * f.row_bytes,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(f.dtype).reshape(num_tokens, *f.shape).clone()
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """(rows, row_bytes) uint8 view of a contiguous tensor."""
    assert t.is_contiguous()
    return t.reshape(t.shape[0], -1).view(torch.uint8).reshape(t.shape[0], -1)


def sentinel_pool(num_blocks: int, block_size: int) -> BlockPool:
    pool = BlockPool(LAYOUT, num_blocks=num_blocks, block_size=block_size)
    for t in pool.tensors.values():
        as_bytes(t).fill_(SENTINEL)
    return pool


def token_row(blocks: Sequence[int] | None, token: int, bs: int) -> int:
    if blocks is None:
        return token
    return blocks[token // bs] * bs + token % bs


def apply(ops: Sequence[WriteOp]) -> None:
    for op in ops:
        assert op.length > 0
        ctypes.memmove(op.dst, op.src, op.length)


def spans(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> list[FieldSpan]:
    return [FieldSpan(src_base=src[n].data_ptr(), dst_base=dst[n].data_ptr(), row_bytes=f.row_bytes)
            for n, f in LAYOUT.items()]


def reference(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], *, num_tokens: int, bs: int,
              dst_blocks: Sequence[int], dst_start: int, src_blocks: Sequence[int] | None,
              src_start: int) -> None:
    """The obviously correct copy: one row at a time."""
    for i in range(num_tokens):
        s = token_row(src_blocks, src_start + i, bs)
        d = token_row(dst_blocks, dst_start + i, bs)
        for name in LAYOUT:
            dst[name][d].copy_(src[name][s])


def check_runs(runs: list[RowRun], num_tokens: int) -> None:
    assert sum(r.count for r in runs) == num_tokens
    assert all(r.count > 0 for r in runs)
    for a, b in itertools.pairwise(runs):
        # coalescing is maximal: adjacent runs are never contiguous on both sides
        assert not (a.src_row + a.count == b.src_row and a.dst_row + a.count == b.dst_row)


def run_case(*, num_tokens: int, bs: int, pool_blocks: int, dst_blocks: Sequence[int], dst_start: int = 0,
             src_blocks: Sequence[int] | None = None, src_start: int = 0, seed: int = 0) -> list[RowRun]:
    """Plan, apply with memmove, compare with a row-by-row reference copy (sentinels included)."""
    src_rows = (max(src_blocks) + 1) * bs if src_blocks else src_start + num_tokens
    src = random_rows(max(src_rows, 1), seed)
    got = sentinel_pool(pool_blocks, bs)
    want = sentinel_pool(pool_blocks, bs)
    runs = plan_row_runs(num_tokens=num_tokens, block_size=bs, dst_blocks=dst_blocks, dst_start=dst_start,
                         src_blocks=src_blocks, src_start=src_start)
    check_runs(runs, num_tokens)
    ops = plan_writes(runs, spans(src, got.tensors))
    assert len(ops) == len(runs) * len(LAYOUT)
    apply(ops)
    reference(src, want.tensors, num_tokens=num_tokens, bs=bs, dst_blocks=dst_blocks, dst_start=dst_start,
              src_blocks=src_blocks, src_start=src_start)
    for name in LAYOUT:
        assert torch.equal(as_bytes(got.tensors[name]), as_bytes(want.tensors[name])), name
    return runs


# -- plan_row_runs ----------------------------------------------------------------------------


def test_contiguous_destination_is_one_op_per_field() -> None:
    runs = run_case(num_tokens=40, bs=8, pool_blocks=10, dst_blocks=[3, 4, 5, 6, 7])
    assert runs == [RowRun(src_row=0, dst_row=24, count=40)]
    src = random_rows(40, 1)
    ops = plan_writes(runs, spans(src, sentinel_pool(10, 8).tensors))
    assert len(ops) == len(LAYOUT)
    assert [op.length for op in ops] == [40 * f.row_bytes for f in LAYOUT.values()]


def test_contiguous_partial_last_block_one_run() -> None:
    runs = run_case(num_tokens=35, bs=8, pool_blocks=10, dst_blocks=[2, 3, 4, 5, 6])
    assert runs == [RowRun(0, 16, 35)]


def test_reversed_blocks_one_op_per_block() -> None:
    runs = run_case(num_tokens=37, bs=8, pool_blocks=8, dst_blocks=[7, 6, 5, 4, 3])
    assert runs == [RowRun(0, 56, 8), RowRun(8, 48, 8), RowRun(16, 40, 8), RowRun(24, 32, 8), RowRun(32, 24, 5)]


def test_interleaved_blocks() -> None:
    runs = run_case(num_tokens=32, bs=4, pool_blocks=16, dst_blocks=[0, 2, 4, 6, 8, 10, 12, 14])
    assert len(runs) == 8
    assert [r.dst_row for r in runs] == [0, 8, 16, 24, 32, 40, 48, 56]


def test_mixed_runs_coalesce_partially() -> None:
    runs = run_case(num_tokens=24, bs=4, pool_blocks=12, dst_blocks=[5, 6, 7, 1, 2, 9])
    assert runs == [RowRun(0, 20, 12), RowRun(12, 4, 8), RowRun(20, 36, 4)]


def test_dst_start_mid_block() -> None:
    runs = run_case(num_tokens=10, bs=4, pool_blocks=6, dst_blocks=[5, 1, 2], dst_start=1)
    # tokens 1..3 of block 5, then block 1 and 2 (adjacent: one run), 3 tokens into block 2
    assert runs == [RowRun(0, 21, 3), RowRun(3, 4, 7)]


def test_src_start_contiguous_source() -> None:
    runs = run_case(num_tokens=6, bs=4, pool_blocks=4, dst_blocks=[2, 3], src_start=100)
    assert runs == [RowRun(100, 8, 6)]


def test_both_sides_blocked_coalesce_only_when_both_adjacent() -> None:
    # source blocks 0,1 adjacent and destination blocks 4,5 adjacent -> one run;
    # then source jumps (1 -> 3) while the destination continues (5 -> 6) -> new run
    runs = run_case(num_tokens=12, bs=4, pool_blocks=8, dst_blocks=[4, 5, 6], src_blocks=[0, 1, 3])
    assert runs == [RowRun(0, 16, 8), RowRun(12, 24, 4)]


def test_src_and_dst_offsets_misaligned() -> None:
    runs = run_case(num_tokens=13, bs=4, pool_blocks=9, dst_blocks=[8, 0, 1, 2, 3], dst_start=2,
                    src_blocks=[6, 7, 2, 3, 0], src_start=3)
    assert sum(r.count for r in runs) == 13
    assert len(runs) >= 3


def test_zero_tokens_plans_nothing() -> None:
    assert plan_row_runs(num_tokens=0, block_size=4, dst_blocks=[]) == []
    assert plan_row_runs(num_tokens=0, block_size=4, dst_blocks=[1], dst_start=4) == []
    assert plan_writes([], [FieldSpan(1, 2, 3)]) == []


def test_plan_writes_field_major_byte_addresses() -> None:
    runs = [RowRun(0, 10, 2), RowRun(5, 0, 1)]
    fields = [FieldSpan(src_base=1000, dst_base=5000, row_bytes=8), FieldSpan(src_base=2000, dst_base=9000,
                                                                              row_bytes=3)]
    assert plan_writes(runs, fields) == [
        WriteOp(src=1000, dst=5080, length=16),
        WriteOp(src=1040, dst=5000, length=8),
        WriteOp(src=2000, dst=9030, length=6),
        WriteOp(src=2015, dst=9000, length=3),
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_tokens": 9, "block_size": 4, "dst_blocks": [0, 1]},
        {"num_tokens": 8, "block_size": 4, "dst_blocks": [0, 1], "dst_start": 1},
        {"num_tokens": 1, "block_size": 4, "dst_blocks": [0], "dst_start": -1},
        {"num_tokens": 1, "block_size": 4, "dst_blocks": []},
        {"num_tokens": 4, "block_size": 4, "dst_blocks": [0], "src_blocks": [0], "src_start": 1},
        {"num_tokens": 5, "block_size": 4, "dst_blocks": [0, 1], "src_blocks": [3]},
        {"num_tokens": 1, "block_size": 4, "dst_blocks": [0], "src_blocks": [0], "src_start": -1},
        {"num_tokens": 1, "block_size": 4, "dst_blocks": [0], "src_start": -1},
        {"num_tokens": -1, "block_size": 4, "dst_blocks": [0]},
        {"num_tokens": 1, "block_size": 0, "dst_blocks": [0]},
    ],
)
def test_plan_error_when_blocks_cannot_hold_range(kwargs: dict[str, object]) -> None:
    with pytest.raises(PlanError):
        plan_row_runs(**kwargs)  # type: ignore[arg-type]


@st.composite
def plan_cases(draw: st.DrawFn) -> dict[str, object]:
    bs = draw(st.integers(1, 9), label="bs")
    pool_blocks = draw(st.integers(1, 12), label="pool")
    dst_n = draw(st.integers(1, pool_blocks), label="dst blocks")
    dst_blocks = draw(st.permutations(range(pool_blocks)), label="dst order")[:dst_n]
    if draw(st.booleans(), label="sorted"):
        dst_blocks = sorted(dst_blocks)
    dst_start = draw(st.integers(0, dst_n * bs - 1), label="dst_start")
    max_tokens = dst_n * bs - dst_start
    src_blocks = None
    src_start = draw(st.integers(0, 20), label="src_start")
    if draw(st.booleans(), label="blocked source"):
        src_n = draw(st.integers(1, 8), label="src blocks")
        src_blocks = draw(st.permutations(range(src_n + draw(st.integers(0, 4)))), label="src order")[:src_n]
        src_start = draw(st.integers(0, src_n * bs - 1), label="src_start")
        max_tokens = min(max_tokens, src_n * bs - src_start)
    num_tokens = draw(st.integers(0, max_tokens), label="tokens")
    return {"num_tokens": num_tokens, "bs": bs, "pool_blocks": pool_blocks, "dst_blocks": dst_blocks,
            "dst_start": dst_start, "src_blocks": src_blocks, "src_start": src_start}


@given(case=plan_cases(), seed=st.integers(0, 1 << 16))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_plans_move_exactly_the_right_bytes(case: dict[str, object], seed: int) -> None:
    runs = run_case(seed=seed, **case)  # type: ignore[arg-type]
    bs = case["bs"]
    assert isinstance(bs, int)
    blocks = case["dst_blocks"]
    assert isinstance(blocks, list)
    if case["src_blocks"] is None and blocks == list(range(blocks[0], blocks[0] + len(blocks))):
        assert len(runs) <= 1  # contiguous on both sides: a single op per field
    for a, b in itertools.pairwise(runs):  # coalesced as far as it goes: no two neighbours could merge
        assert not (a.src_row + a.count == b.src_row and a.dst_row + a.count == b.dst_row), (a, b)


@given(case=plan_cases())
@settings(max_examples=50, deadline=None)
def test_too_few_blocks_refused(case: dict[str, object]) -> None:
    dst_blocks = case["dst_blocks"]
    assert isinstance(dst_blocks, list)
    bs, dst_start = case["bs"], case["dst_start"]
    assert isinstance(bs, int) and isinstance(dst_start, int)
    too_many = len(dst_blocks) * bs - dst_start + 1
    with pytest.raises(PlanError):
        plan_row_runs(num_tokens=too_many, block_size=bs, dst_blocks=dst_blocks, dst_start=dst_start)


# -- BlockPool --------------------------------------------------------------------------------


def test_pool_shape_and_regions() -> None:
    pool = BlockPool(LAYOUT, num_blocks=5, block_size=4)
    assert pool.num_tokens == 20
    assert list(pool.tensors) == list(LAYOUT)
    assert pool.tensors["embeddings"].shape == (20, 64) and pool.tensors["embeddings"].dtype == torch.bfloat16
    assert pool.tensors["token_ids"].shape == (20,) and pool.tensors["token_ids"].dtype == torch.int32
    assert pool.tensors["mrope_positions"].shape == (20, 3)
    assert pool.nbytes == 20 * LAYOUT.bytes_per_token
    regions = pool.regions()
    assert len(regions) == 3
    for r, t in zip(regions, pool.tensors.values(), strict=True):
        assert r.address == t.data_ptr() and r.length == t.numel() * t.element_size() and r.device == "cpu"
    assert all(t.is_contiguous() for t in pool.tensors.values())


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_pool_bad_size(num_blocks: int, block_size: int) -> None:
    with pytest.raises(PlanError):
        BlockPool(LAYOUT, num_blocks=num_blocks, block_size=block_size)


ROUND_TRIP_CASES = [
    (blocks, n)
    for blocks in ([5, 1, 8, 0], [8, 7, 6, 5], [2, 3, 4, 5], [9], [1, 9, 3])
    for n in (1, 3, 4, 7, 8, 13, 16)
    if n <= len(blocks) * 4
]


@pytest.mark.parametrize(("blocks", "num_tokens"), ROUND_TRIP_CASES)
def test_pool_copy_in_copy_out_round_trip(blocks: list[int], num_tokens: int) -> None:
    bs = 4
    pool = sentinel_pool(10, bs)
    src = random_rows(num_tokens + 5, seed=num_tokens)
    pool.copy_in(blocks, src, src_start=5, num_tokens=num_tokens)
    # exactly the addressed rows changed, everything else still holds the sentinel
    for name in LAYOUT:
        t = as_bytes(pool.tensors[name])
        written = {token_row(blocks, i, bs) for i in range(num_tokens)}
        for row in range(pool.num_tokens):
            if row in written:
                i = next(i for i in range(num_tokens) if token_row(blocks, i, bs) == row)
                assert torch.equal(t[row], as_bytes(src[name])[5 + i])
            else:
                assert bool((t[row] == SENTINEL).all()), (name, row)
    out = LAYOUT.empty(num_tokens + 3)
    for t in out.values():
        as_bytes(t).fill_(0x11)
    pool.copy_out(blocks, num_tokens, out, out_start=2)
    for name in LAYOUT:
        o = as_bytes(out[name])
        assert torch.equal(o[2:2 + num_tokens], as_bytes(src[name])[5:5 + num_tokens])
        assert bool((o[:2] == 0x11).all()) and bool((o[2 + num_tokens:] == 0x11).all())


def test_pool_partial_last_block_leaves_rest_untouched() -> None:
    pool = sentinel_pool(4, 8)
    src = random_rows(11, 3)
    pool.copy_in([3, 1], src, src_start=0, num_tokens=11)
    for name in LAYOUT:
        t = as_bytes(pool.tensors[name])
        assert torch.equal(t[24:32], as_bytes(src[name])[:8])
        assert torch.equal(t[8:11], as_bytes(src[name])[8:11])
        assert bool((t[11:16] == SENTINEL).all())
        assert bool((t[0:8] == SENTINEL).all()) and bool((t[16:24] == SENTINEL).all())


def test_pool_views_are_zero_copy_runs() -> None:
    pool = sentinel_pool(8, 4)
    src = random_rows(18, 9)
    blocks = [6, 7, 0, 1, 3]
    pool.copy_in(blocks, src, src_start=0, num_tokens=18)
    views = pool.views(blocks, 18)
    assert list(views) == list(LAYOUT)
    for name, parts in views.items():
        assert [p.shape[0] for p in parts] == [8, 8, 2]  # blocks 6-7, 0-1, and half of 3
        assert torch.equal(as_bytes(torch.cat(parts)), as_bytes(src[name]))
        base = pool.tensors[name]
        for p in parts:
            assert base.data_ptr() <= p.data_ptr() < base.data_ptr() + base.numel() * base.element_size()
    views["token_ids"][1][0] = 12345
    assert int(pool.tensors["token_ids"][0]) == 12345


def test_pool_runs_with_start() -> None:
    pool = BlockPool(LAYOUT, num_blocks=8, block_size=4)
    assert pool.runs([6, 2, 3], 6, start=3) == [RowRun(0, 27, 1), RowRun(1, 8, 5)]


def test_pool_multiple_rounds_into_one_output() -> None:
    """Resume-style: each round lands in fresh blocks and is copied into its slice of one output."""
    bs, total = 4, 30
    pool = sentinel_pool(5, bs)
    src = random_rows(total, 21)
    out = LAYOUT.empty(total)
    rng = random.Random(4)
    done = 0
    while done < total:
        n = min(rng.randint(1, 20), total - done)
        blocks = rng.sample(range(5), -(-n // bs))
        pool.copy_in(blocks, src, src_start=done, num_tokens=n)
        pool.copy_out(blocks, n, out, out_start=done)
        done += n
    for name in LAYOUT:
        assert torch.equal(as_bytes(out[name]), as_bytes(src[name]))


def test_pool_errors() -> None:
    pool = BlockPool(LAYOUT, num_blocks=4, block_size=4)
    src = random_rows(8, 0)
    with pytest.raises(PlanError, match="outside"):
        pool.copy_in([4], src, src_start=0, num_tokens=1)
    with pytest.raises(PlanError, match="outside"):
        pool.copy_in([-1], src, src_start=0, num_tokens=1)
    with pytest.raises(PlanError):
        pool.copy_in([0], src, src_start=0, num_tokens=5)  # one block holds 4
    with pytest.raises(PlanError, match="source has 8 tokens"):
        pool.copy_in([0, 1], src, src_start=4, num_tokens=5)
    with pytest.raises(LayoutError, match="token_ids"):
        pool.copy_in([0], {k: v for k, v in src.items() if k != "token_ids"}, src_start=0, num_tokens=1)
    out = LAYOUT.empty(3)
    with pytest.raises(PlanError, match="output has 3 tokens"):
        pool.copy_out([0], 4, out, out_start=0)
    with pytest.raises(PlanError, match="output has 3 tokens"):
        pool.copy_out([0], 2, out, out_start=2)
    with pytest.raises(LayoutError):
        pool.copy_out([0], 1, {}, out_start=0)
    with pytest.raises(PlanError):
        pool.views([0, 1], 9)
    with pytest.raises(PlanError, match="outside"):
        pool.views([7], 1)


def test_pool_copy_in_negative_src_start_refused() -> None:
    pool = sentinel_pool(2, 4)
    src = random_rows(10, 0)
    with pytest.raises(PlanError):
        pool.copy_in([0], src, src_start=-2, num_tokens=1)
    assert bool((as_bytes(pool.tensors["token_ids"]) == SENTINEL).all())


def test_pool_copy_out_negative_out_start_refused() -> None:
    pool = sentinel_pool(2, 4)
    out = LAYOUT.empty(10)
    for t in out.values():
        as_bytes(t).fill_(0x11)
    with pytest.raises(PlanError):
        pool.copy_out([0], 1, out, out_start=-2)
    assert bool((as_bytes(out["token_ids"]) == 0x11).all())


def test_copies_in_and_out_record_no_autograd() -> None:
    """``copy_in`` / ``copy_out`` move bytes. Through ``copy_`` (a CUDA pool, an output whose memory is not laid out
    as its values) with autograd on, an output that requires grad raised "a view of a leaf Variable that requires
    grad is being used in an in-place operation" once its rows had landed, and a source that requires grad made the
    pool part of its graph."""
    layout = Layout(emb=Field((2,), torch.float32))
    pool = BlockPool(layout, num_blocks=4, block_size=4)
    src = {"emb": torch.randn(8, 2, requires_grad=True)}
    pool.copy_in([2, 0], src, src_start=0, num_tokens=8)
    assert not pool.tensors["emb"].requires_grad and pool.tensors["emb"].grad_fn is None
    leaf = torch.zeros(8, 4, requires_grad=True)
    out = {"emb": leaf[:, ::2]}  # strided: filled through copy_
    pool.copy_out([2, 0], 8, out, out_start=0)
    assert torch.equal(out["emb"].detach(), src["emb"].detach())
