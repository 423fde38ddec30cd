"""The sender's staging area hands out row ranges, and takes back one whose copy failed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aioembed import Field, Layout
from aioembed.errors import AllocatorError
from aioembed.memory.staging import RangeAllocator, StagingArea


def test_rows_are_copied_in_and_a_failed_copy_gives_its_range_back() -> None:
    layout = Layout(ids=Field((), torch.int32), emb=Field((4,), torch.bfloat16))
    area = StagingArea(layout, 16, 16)
    bad = {"ids": torch.arange(4, dtype=torch.int32), "emb": torch.zeros(4, 4, dtype=torch.bfloat16).to_sparse()}
    with pytest.raises(RuntimeError):
        area.stage(bad, 4)  # the second field cannot be copied (the first already was)
    assert area.used == 0  # the range went back (it leaked for good)
    src = {"ids": torch.arange(16, dtype=torch.int32), "emb": torch.randn(16, 4).to(torch.bfloat16)}
    staged = area.stage(src, 16)  # the whole area is free again
    assert staged is not None and area.used == 16
    assert all(torch.equal(staged.tensors[n], src[n]) for n in src)
    area.release(staged)
    assert area.used == 0


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 99)), max_size=60))
def test_ranges_never_overlap_and_a_free_run_is_always_found(capacity: int,
                                                               steps: list[tuple[bool, int, int]]) -> None:
    """Against a model of which units are taken: a range is taken only where every unit is free, ``None`` only when
    no free run is long enough (free neighbours are merged), and the counts add up after every step."""
    ranges = RangeAllocator(capacity)
    held: dict[int, int] = {}
    for take, n, pick in steps:
        taken = {u for start, k in held.items() for u in range(start, start + k)}
        if take or not held:
            start = ranges.take(n)
            fits = any(taken.isdisjoint(range(s, s + n)) for s in range(capacity - n + 1))
            if start is None:
                assert not fits, (capacity, held, n)
            else:
                assert start >= 0 and start + n <= capacity and taken.isdisjoint(range(start, start + n))
                held[start] = n
        else:
            start = sorted(held)[pick % len(held)]
            ranges.give(start)
            del held[start]
            with pytest.raises(AllocatorError, match="double free"):
                ranges.give(start)
        assert ranges.used == sum(held.values()) and ranges.free == capacity - ranges.used


def test_a_source_that_requires_grad_is_staged_without_autograd() -> None:
    """An encoder run outside ``no_grad`` / ``inference_mode`` hands over tensors that require grad. One that takes
    the ``copy_`` path (strided here) was copied with autograd on: the staging area joined its graph (``requires_grad``,
    a ``grad_fn``) and held every such source alive, one more per ``send()``, for the sender's life."""
    layout = Layout(emb=Field((4,), torch.float32))
    area = StagingArea(layout, 32, 16)
    base = torch.randn(16, 8, requires_grad=True)
    src = {"emb": base[:, ::2]}
    staged = area.stage(src, 16)
    assert staged is not None and torch.equal(staged.tensors["emb"], src["emb"].detach())
    assert not area.tensors["emb"].requires_grad and area.tensors["emb"].grad_fn is None
    held = weakref.ref(base)
    del base, src
    gc.collect()
    assert held() is None, "the staging area keeps the source alive"
