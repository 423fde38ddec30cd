"""Registration accounting between aioembed's refcounted regions and the engine's registrations.

aioembed's contract lets a caller register the same or overlapping regions several times and
undo each registration with one matching ``unregister``. The Mooncake engine refuses a
registration that overlaps one it already holds (``-7``, "does not support overlapped memory
region") and can only unregister a registration as a whole, by its start address.

:class:`EngineRegistrations` bridges the two, with no I/O (so it is tested on its own):

* ``regions`` is the aioembed view: a :class:`~aioembed.transports.base.RegionSet` with
  reference counts. Write sources are checked against it, and the descriptor lists it.
* ``pieces`` are the engine's registrations: disjoint ``[start, end)`` spans. Registering a
  region registers only the parts of it that no piece covers yet (its *gaps*), so a piece is
  never registered twice and pieces never overlap.
* A piece is unregistered once **no** registered region overlaps it any more. A piece that is
  still partly covered stays registered as a whole: the engine cannot shrink a registration,
  and re-registering the covered part would briefly unregister memory a concurrent write may
  be using. Overlapping regions come from one allocation (two live allocations cannot share
  addresses), so a piece kept alive this way only covers memory that is still allocated.

Pieces are disjoint but may abut; a transfer whose span crosses from one piece into the next
is cut at the boundary (:meth:`EngineRegistrations.cut_points`), because RDMA needs one
memory registration per scatter-gather element.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from aioembed.errors import TransportError
from aioembed.transports.base import MemoryRegion, RegionSet

__all__ = ["EngineRegistrations", "Piece", "PieceIndex", "merge_spans"]


class Piece(NamedTuple):
    """One engine registration: ``[start, end)``."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def merge_spans(spans: Iterable[tuple[int, int]], *, touching: bool = True) -> list[tuple[int, int]]:
    """Sorted, merged ``[start, end)`` spans (overlapping spans are joined, and touching ones unless
    ``touching`` is false)."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and (s <= out[-1][1] if touching else s < out[-1][1]):
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


class PieceIndex:
    """Sorted disjoint pieces with O(log n) lookups."""

    __slots__ = ("_ends", "_starts")

    def __init__(self, pieces: Iterable[Piece] = ()) -> None:
        ps = sorted(pieces)
        for a, b in itertools.pairwise(ps):
            if b.start < a.end:
                raise TransportError(f"engine registrations overlap: {a} and {b}")
        self._starts = [p.start for p in ps]
        self._ends = [p.end for p in ps]

    def __len__(self) -> int:
        return len(self._starts)

    def pieces(self) -> list[Piece]:
        return [Piece(s, e) for s, e in zip(self._starts, self._ends, strict=True)]

    def cut_points(self, address: int, length: int) -> list[int]:
        """Sorted offsets in ``(0, length)`` where ``[address, address + length)`` crosses a piece boundary."""
        end = address + length
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and end <= self._ends[i]:
            return []  # inside one piece (every write op of a registered tensor or pool field)
        i = max(i, 0)
        cuts: set[int] = set()
        while i < len(self._starts) and self._starts[i] < end:
            for b in (self._starts[i], self._ends[i]):
                if address < b < end:
                    cuts.add(b - address)
            i += 1
        return sorted(cuts)

    def gaps(self, start: int, end: int) -> list[Piece]:
        """The parts of ``[start, end)`` that no piece covers."""
        out: list[Piece] = []
        pos = start
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while i < len(self._starts) and self._starts[i] < end and pos < end:
            s, e = self._starts[i], self._ends[i]
            if e > pos:
                if s > pos:
                    out.append(Piece(pos, s))
                pos = max(pos, e)
            i += 1
        if pos < end:
            out.append(Piece(pos, end))
        return out


class EngineRegistrations:
    """The aioembed regions of one endpoint and the engine pieces that back them."""

    __slots__ = ("_pieces", "_refused", "regions")

    def __init__(self) -> None:
        self.regions = RegionSet()
        self._pieces: set[Piece] = set()
        self._refused: set[Piece] = set()
        """Orphans the engine refused to unregister: retried one at a time (see :meth:`refused`)."""

    @property
    def pieces(self) -> list[Piece]:
        """The engine registrations, sorted."""
        return sorted(self._pieces)

    def index(self) -> PieceIndex:
        return PieceIndex(self._pieces)

    def plan_add(self, regions: Sequence[MemoryRegion]) -> list[Piece]:
        """Engine registrations needed before ``regions`` are usable (no state change)."""
        idx = self.index()
        new: list[Piece] = []
        # Touching regions stay apart (two allocations may abut): each gets its own piece, given back with it.
        for s, e in merge_spans(((r.address, r.end) for r in regions), touching=False):
            new.extend(idx.gaps(s, e))
        return new

    def commit_add(self, regions: Sequence[MemoryRegion], new_pieces: Sequence[Piece]) -> None:
        """Record ``regions`` as registered, backed by the (now registered) ``new_pieces``."""
        self._pieces.update(new_pieces)
        self.regions.add(regions)

    def remove(self, regions: Sequence[MemoryRegion]) -> list[Piece]:
        """Undo one registration of each region; returns the pieces no region overlaps any more.

        Raises ``TransportError`` (changing nothing) if a region is not registered. The pieces
        returned stay recorded until :meth:`forget` (call it once the engine let them go).
        """
        self.regions.remove(regions)
        return self.orphans()

    def orphans(self) -> list[Piece]:
        """Pieces that no registered region overlaps."""
        live = merge_spans((r.address, r.end) for r in self.regions)
        starts = [s for s, _ in live]
        out = []
        for p in sorted(self._pieces):
            i = bisect.bisect_left(starts, p.end) - 1  # last live span starting before p.end
            if i < 0 or live[i][1] <= p.start:
                out.append(p)
        return out

    def forget(self, pieces: Iterable[Piece]) -> None:
        """Drop pieces the engine has unregistered."""
        pieces = set(pieces)
        self._pieces.difference_update(pieces)
        self._refused.difference_update(pieces)

    def refuse(self, pieces: Iterable[Piece]) -> None:
        """Note orphans the engine refused to unregister (they stay recorded, for a retry)."""
        self._refused.update(pieces)

    def refused(self, pieces: Iterable[Piece]) -> list[Piece]:
        """Those of ``pieces`` the engine refused to unregister before. They are retried apart from the others:
        the engine keeps every span of a failed batch in its own table, so one span that fails again would keep
        the others of its batch there too (see ``MooncakeTransport._unregister_pieces``)."""
        return [p for p in pieces if p in self._refused]

    def clear(self) -> list[Piece]:
        """Forget every region; returns every piece (for unregistering at close)."""
        self.regions = RegionSet()
        self._refused.clear()
        return self.pieces
