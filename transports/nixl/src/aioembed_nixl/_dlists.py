"""How a write's ops become NIXL descriptor indices: pure planning, no NIXL calls (tested on its own).

NIXL moves data between *descriptors*: ``make_prepped_xfer`` pairs descriptor ``i`` of a prepared
local list with descriptor ``j`` of a prepared remote list (same length), and merges pairs that are
contiguous on both sides back into one operation. Preparing a list validates every descriptor against
the registrations (remote ones: against the peer's metadata) and resolves backend keys, so the pool's
list is prepared once per link and each write only names indices into it.

aioembed's ops are byte spans, not blocks, so the plugin learns the granule of each of the peer's
segments from the ops themselves: the gcd of every offset and length written there so far (starting
from the segment's length). For a block pool that converges to a row or block of the field within a
few writes; the list is prepared again only when the granule shrinks. A write whose granules would
make the list (or the write's own list) too long is sent with lists built for that write alone.

A descriptor must lie inside one registration, and registrations may overlap (aioembed allows that),
so both sides are first cut into *segments*: the registered address space split at every region edge.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from aioembed.transports.base import MemoryRegion

__all__ = [
    "MAX_LIST_DESCS",
    "MAX_WRITE_DESCS",
    "GranuleList",
    "Piece",
    "Segment",
    "SegmentIndex",
    "WritePlan",
    "cut_pieces",
    "device_id",
    "mem_type",
]

MAX_LIST_DESCS = 1 << 18
"""Most descriptors in one prepared remote list (preparing 65536 took ~2 ms here)."""
MAX_WRITE_DESCS = 1 << 16
"""Most descriptors one write may name; past that it uses lists built for it alone."""


def mem_type(device: str) -> str:
    """NIXL's memory type for an aioembed device name."""
    return "DRAM" if device == "cpu" else "VRAM"


def device_id(device: str) -> int:
    """NIXL's device id: the GPU index for ``cuda:N``, 0 for host memory."""
    return 0 if device == "cpu" else int(device.split(":", 1)[1])


class Segment(NamedTuple):
    """``[start, end)`` inside one registered region of ``device``."""

    start: int
    end: int
    device: str


class SegmentIndex:
    """Registered regions cut at every region edge: disjoint segments, each inside one registration."""

    __slots__ = ("_starts", "segments")

    def __init__(self, regions: Iterable[MemoryRegion] = ()) -> None:
        events: list[tuple[int, int, str]] = []
        for r in regions:
            events.append((r.address, 1, r.device))
            events.append((r.end, -1, r.device))
        events.sort(key=lambda e: e[0])
        segments: list[Segment] = []
        active: dict[str, int] = {}
        prev: int | None = None
        i = 0
        while i < len(events):
            pos = events[i][0]
            if prev is not None and prev < pos:
                devices = [d for d, n in active.items() if n > 0]
                if devices:
                    segments.append(Segment(prev, pos, devices[0]))
            while i < len(events) and events[i][0] == pos:
                _, delta, device = events[i]
                active[device] = active.get(device, 0) + delta
                i += 1
            prev = pos
        self.segments = segments
        self._starts = [s.start for s in segments]

    def __len__(self) -> int:
        return len(self.segments)

    def find(self, address: int) -> int:
        """The index of the segment holding ``address``, or -1."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self.segments[i].end:
            return i
        return -1


class Piece(NamedTuple):
    """Part of an op inside one local and one remote segment."""

    src: int
    dst: int
    length: int
    local: int
    """Index of the local segment."""
    remote: int
    """Index of the remote segment."""


def cut_pieces(ops: Sequence[tuple[int, int, int]], local: SegmentIndex, remote: SegmentIndex) -> list[Piece]:
    """Cut ``(src, dst, length)`` ops where either side crosses a segment edge.

    Raises ``ValueError`` for a span that leaves registered memory (the transport checks this first)."""
    pieces: list[Piece] = []
    for src, dst, n in ops:
        pos = 0
        while pos < n:
            li, ri = local.find(src + pos), remote.find(dst + pos)
            if li < 0:
                raise ValueError(f"source byte {src + pos:#x} is not in registered memory")
            if ri < 0:
                raise ValueError(f"destination byte {dst + pos:#x} is not in the peer's registered memory")
            step = min(n - pos, local.segments[li].end - (src + pos), remote.segments[ri].end - (dst + pos))
            pieces.append(Piece(src + pos, dst + pos, step, li, ri))
            pos += step
    return pieces


@dataclass(frozen=True)
class WritePlan:
    """What one NIXL transfer of a write names."""

    local: npt.NDArray[np.uint64]
    """``N x 3`` local descriptors (address, length, device id), to prepare for this write."""
    remote_indices: npt.NDArray[np.int32] | None
    """Indices into the prepared remote list, or None: then ``remote`` is this write's own list."""
    remote: npt.NDArray[np.uint64] | None
    """``N x 3`` remote descriptors for a write that does not use the prepared list."""
    nbytes: int


class GranuleList:
    """The prepared remote list of one peer for one memory type: its segments, each at a granule."""

    def __init__(self, segments: Sequence[Segment], max_descs: int = MAX_LIST_DESCS,
                 max_write_descs: int = MAX_WRITE_DESCS) -> None:
        self.segments = list(segments)
        self.granule = [s.end - s.start for s in self.segments]
        self.max_descs = max_descs
        self.max_write_descs = max_write_descs
        self.version = 0
        """Bumped whenever the list must be prepared again."""
        self._base = self._bases(self.granule)

    def _bases(self, granule: Sequence[int]) -> list[int]:
        base, out = 0, []
        for s, g in zip(self.segments, granule, strict=True):
            out.append(base)
            base += (s.end - s.start) // g
        return out

    def count(self, granule: Sequence[int] | None = None) -> int:
        """Descriptors in the list (at ``granule``, default the current one)."""
        granule = self.granule if granule is None else granule
        return sum((s.end - s.start) // g for s, g in zip(self.segments, granule, strict=True))

    def descriptors(self) -> npt.NDArray[np.uint64]:
        """``N x 3`` (address, length, device id) of the whole list, segment by segment."""
        parts = []
        for s, g in zip(self.segments, self.granule, strict=True):
            k = (s.end - s.start) // g
            part = np.empty((k, 3), dtype=np.uint64)
            part[:, 0] = np.uint64(s.start) + np.arange(k, dtype=np.uint64) * np.uint64(g)
            part[:, 1] = g
            part[:, 2] = device_id(s.device)
            parts.append(part)
        return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)

    def plan(self, pieces: Sequence[Piece], local: SegmentIndex) -> WritePlan:
        """Descriptors for ``pieces`` (all into this list's segments). Refines the granules (bumping
        :attr:`version`) when the pieces need a finer one and the list stays within bounds."""
        granule = list(self.granule)
        for p in pieces:
            s = self.segments[p.remote]
            granule[p.remote] = math.gcd(granule[p.remote], p.dst - s.start, p.length)
        lengths = np.fromiter((p.length for p in pieces), dtype=np.int64, count=len(pieces))
        g = np.fromiter((granule[p.remote] for p in pieces), dtype=np.int64, count=len(pieces))
        counts = lengths // g
        total = int(counts.sum())
        nbytes = int(lengths.sum())
        if total > self.max_write_descs or (granule != self.granule and self.count(granule) > self.max_descs):
            return self._own_lists(pieces, local, nbytes)
        if granule != self.granule:
            self.granule = granule
            self._base = self._bases(granule)
            self.version += 1
        src = np.fromiter((p.src for p in pieces), dtype=np.int64, count=len(pieces))
        first = np.fromiter(((p.dst - self.segments[p.remote].start) // granule[p.remote] + self._base[p.remote]
                             for p in pieces), dtype=np.int64, count=len(pieces))
        which = np.repeat(np.arange(len(pieces)), counts)
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        arr = np.empty((total, 3), dtype=np.uint64)
        arr[:, 0] = (src[which] + within * g[which]).astype(np.uint64)
        arr[:, 1] = g[which].astype(np.uint64)
        arr[:, 2] = np.fromiter((device_id(local.segments[p.local].device) for p in pieces), dtype=np.uint64,
                                count=len(pieces))[which]
        indices = (first[which] + within).astype(np.int32)
        return WritePlan(local=arr, remote_indices=indices, remote=None, nbytes=nbytes)

    def _own_lists(self, pieces: Sequence[Piece], local: SegmentIndex, nbytes: int) -> WritePlan:
        """One descriptor per piece on both sides, for this write only."""
        loc = np.array([(p.src, p.length, device_id(local.segments[p.local].device)) for p in pieces],
                       dtype=np.uint64).reshape(-1, 3)
        rem = np.array([(p.dst, p.length, device_id(self.segments[p.remote].device)) for p in pieces],
                       dtype=np.uint64).reshape(-1, 3)
        return WritePlan(local=loc, remote_indices=None, remote=rem, nbytes=nbytes)
