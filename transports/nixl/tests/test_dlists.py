"""Planning a write's descriptors (no NIXL involved): segments, pieces, granules, fallback lists."""

from __future__ import annotations

import numpy as np
import pytest
from aioembed.transports.base import MemoryRegion

from aioembed_nixl._dlists import GranuleList, Segment, SegmentIndex, cut_pieces


def test_overlapping_registrations_become_disjoint_segments_inside_one_registration_each() -> None:
    idx = SegmentIndex([MemoryRegion(1000, 1000), MemoryRegion(1000, 500), MemoryRegion(1200, 2000),
                        MemoryRegion(5000, 10)])
    assert [(s.start, s.end) for s in idx.segments] == [(1000, 1200), (1200, 1500), (1500, 2000), (2000, 3200),
                                                         (5000, 5010)]
    assert idx.find(999) == -1 and idx.find(1000) == 0 and idx.find(3199) == 3 and idx.find(3200) == -1
    assert idx.find(5009) == 4


def test_pieces_are_cut_at_segment_edges_of_both_sides() -> None:
    local = SegmentIndex([MemoryRegion(100, 50), MemoryRegion(150, 50)])
    remote = SegmentIndex([MemoryRegion(1000, 30), MemoryRegion(1030, 100)])
    pieces = cut_pieces([(100, 1000, 100)], local, remote)
    assert [(p.src, p.dst, p.length) for p in pieces] == [(100, 1000, 30), (130, 1030, 20), (150, 1050, 50)]
    with pytest.raises(ValueError, match="destination"):
        cut_pieces([(100, 1100, 40)], local, remote)


def test_granule_is_learned_from_the_ops_and_then_stays() -> None:
    row, rows = 7168, 1024
    seg = Segment(1 << 20, (1 << 20) + row * rows, "cpu")
    glist = GranuleList([seg])
    local = SegmentIndex([MemoryRegion(1 << 30, row * rows)])
    assert glist.count() == 1  # untouched: the whole segment is one descriptor

    def write(first_row: int, n_rows: int) -> np.ndarray:
        pieces = cut_pieces([((1 << 30) + first_row * row, seg.start + first_row * row, n_rows * row)],
                            local, SegmentIndex([MemoryRegion(seg.start, seg.end - seg.start)]))
        plan = glist.plan(pieces, local)
        assert plan.remote_indices is not None and plan.nbytes == n_rows * row
        assert int(plan.local[:, 1].sum()) == n_rows * row
        return plan.remote_indices

    idx = write(128, 256)  # block-shaped: granule 128 rows
    assert glist.granule == [128 * row] and glist.version == 1
    assert idx.tolist() == [1, 2]
    write(0, 128)
    write(512, 384)
    assert glist.version == 1  # same shapes: the prepared list is reused, nothing rebuilt
    idx = write(640, 32)  # a partial tail block: granule 32 rows, prepared once more
    assert glist.granule == [32 * row] and glist.version == 2
    assert idx.tolist() == [20]
    assert glist.count() == rows // 32
    desc = glist.descriptors()
    assert desc.shape == (32, 3) and int(desc[1, 0]) == seg.start + 32 * row and int(desc[0, 1]) == 32 * row


def test_shapes_that_would_need_too_many_descriptors_get_lists_of_their_own() -> None:
    seg = Segment(4096, 4096 + (1 << 20), "cpu")
    glist = GranuleList([seg], max_descs=1024)
    local = SegmentIndex([MemoryRegion(1 << 30, 1 << 20)])
    remote = SegmentIndex([MemoryRegion(seg.start, 1 << 20)])
    pieces = cut_pieces([((1 << 30) + 1, seg.start + 7, 1000)], local, remote)  # granule would be 1 byte
    plan = glist.plan(pieces, local)
    assert plan.remote_indices is None and plan.remote is not None
    assert plan.remote.tolist() == [[seg.start + 7, 1000, 0]] and plan.local.tolist() == [[(1 << 30) + 1, 1000, 0]]
    assert glist.version == 0 and glist.count() == 1  # the prepared list was left alone
