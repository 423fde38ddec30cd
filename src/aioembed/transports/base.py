"""The transport interface: register memory, exchange a descriptor, write bytes to a peer.

A transport is deliberately small (compare httpcore's ``AsyncBaseTransport``): the session
layer plans *what* to write; a transport only moves bytes between registered regions.

Contract every implementation keeps (checked by :mod:`aioembed.testing`):

* ``register`` may be called with regions that overlap or repeat ones already registered;
  each registration is undone by one matching ``unregister`` of the same region.
* ``descriptor()`` is an opaque ``bytes`` blob; it lists the regions registered at the time
  of the call, and a peer may only write inside those.
* ``Link.write(ops)`` returns only once every byte is visible in the destination's memory;
  a failure raises :class:`~aioembed.errors.TransportError` and never reports success.
* A write whose destination is outside the peer's announced regions, or whose source is
  outside this side's registered regions, raises ``TransportError`` before moving anything;
  except, for the source, on an endpoint that reads unregistered memory of that device
  (``reads_unregistered``): such an endpoint does not check sources, and a caller passes it
  unregistered memory only on a device it answered true for (anything else is undefined: a
  device address read as host memory may crash the process). The sessions do.
* After ``aclose()`` (of the link or the transport) writes raise ``TransportError``.
* A refused write moves nothing, none of its ops; one that failed otherwise lands nothing once it raised
  if ``may_land`` is false (or unset on a ``cancel_safe_writes`` transport), and a cancelled one likewise on a
  ``cancel_safe_writes`` transport; neither reads its sources again.
* ``aclose()`` of the endpoint that owns the memory returns only once no write lands in it any more (the
  receiver frees its pool then, fenced blocks included); of a writer, nothing of its writes lands, nor is a
  source read, past ``orphan_lifetime`` after it returned.
* ``aclose()`` of a transport is idempotent and returns only once the endpoint is closed, also when
  another ``aclose()`` is under way.
* ``write_lifetime`` bounds how long a failed write may still land at a *running* destination,
  ``orphan_lifetime`` how long any write of a writer whose process has ended may. The sessions
  keep blocks fenced for that long. A transport that cannot bound a failed write by time but sees
  it end raises its ``TransportError`` with ``settled`` (see there): the blocks then stay fenced
  until that returns, plus ``orphan_lifetime``, and at least ``write_lifetime``.
* A transport with ``revocable`` implements ``revoke(writer_id)``: once it returns, nothing lands
  any more through any link that writer opened to this endpoint so far (writes posted earlier
  included); links it opens later work (a sender opens one link per receiver session).

Plugins raise ``TransportError`` (or ``ConfigError`` for bad options); anything else they raise is
turned into a ``TransportError`` by :mod:`aioembed.transports.boundary` before a session sees it.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Self

from aioembed.errors import TransportError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Link",
    "MemoryRegion",
    "RegionSet",
    "Transport",
    "TransportCapabilities",
    "WriteOp",
]


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A span of memory: start address, length in bytes, and device (``cpu`` or ``cuda:N``)."""

    address: int
    length: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.address <= 0 or self.length <= 0:
            raise TransportError(f"memory region needs a positive address and length, got {self}")

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.address + self.length

    @classmethod
    def of_tensor(cls, t: torch.Tensor) -> MemoryRegion:
        """The region of a contiguous tensor's storage (``cpu`` or ``cuda:N``)."""
        if not t.is_contiguous():
            raise TransportError(f"only a contiguous tensor is one memory region, got strides {t.stride()}")
        device = "cpu" if t.device.type == "cpu" else f"cuda:{t.device.index or 0}"
        return cls(t.data_ptr(), t.numel() * t.element_size(), device)


@dataclass(frozen=True, slots=True)
class WriteOp:
    """Copy ``length`` bytes from local address ``src`` to the peer's address ``dst``."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True, slots=True)
class TransportCapabilities:
    """What a transport can do, so the session can refuse a bad combination up front."""

    cuda: bool = False
    """Can register and write CUDA device memory."""
    asyncio_only: bool = False
    """Works only under asyncio (not trio)."""
    cross_process: bool = True
    """Peers may live in other processes (false for the in-process loopback)."""
    cancel_safe_writes: bool = True
    """A write that failed never lands later. False when a failed (timed-out) write may still
    reach the destination afterwards: the session then fences the destination blocks."""
    revocable: bool = False
    """``Transport.revoke(writer_id)`` can cut off the links a writer opened so far: afterwards
    nothing lands through them."""
    write_lifetime: float = 0.0
    """Seconds a write that *failed* (its writer alive) may still land at a running destination
    (a native engine's retries, data in socket buffers). The default for a plugin;
    ``Transport.write_lifetime`` may refine it from the endpoint's options."""
    orphan_lifetime: float = 0.0
    """Seconds the writes of a writer whose *process ended* may still land at a running destination
    (data its kernel had already sent or buffered). Counted in the destination's running time."""


class RegionSet:
    """Registered regions with reference counts, and O(log n) containment checks.

    Overlapping and repeated registrations are allowed; the covered address ranges are
    kept merged so that a span crossing two abutting registrations still counts as covered.
    The merged spans are updated where a registration changes them, not rebuilt: a sender registers
    and unregisters its caller's tensors for every ``send()``, and re-sorting every region at each
    change made a burst of outstanding sends quadratic (10,000 of them: 167 rooms/s against 1,332).
    """

    __slots__ = ("_counts", "_ends", "_span_regions", "_spans", "_starts", "_total")

    def __init__(self, regions: Iterable[MemoryRegion] = ()) -> None:
        self._counts: Counter[MemoryRegion] = Counter()
        self._total = 0
        self._span_regions: Counter[tuple[int, int]] = Counter()
        """(start, end) -> distinct registered regions with that span (one per device)."""
        self._spans: list[tuple[int, int]] = []
        """The distinct spans of :attr:`_span_regions`, sorted."""
        self._starts: list[int] = []  # the merged spans: disjoint, never abutting, sorted
        self._ends: list[int] = []
        self.add(regions)

    def __len__(self) -> int:
        return self._total

    def __iter__(self) -> Any:
        return iter(sorted(self._counts, key=lambda r: (r.address, r.length)))

    def add(self, regions: Iterable[MemoryRegion]) -> list[MemoryRegion]:
        """Add regions; returns those that were not registered before (count went 0 -> 1)."""
        new = []
        for r in regions:
            if self._counts[r] == 0:
                new.append(r)
                self._span_added(r.address, r.end)
            self._counts[r] += 1
            self._total += 1
        return new

    def remove(self, regions: Iterable[MemoryRegion]) -> list[MemoryRegion]:
        """Remove one registration of each region; returns those now fully gone.

        Raises ``TransportError`` (removing nothing) for a region that is not registered.
        """
        regions = list(regions)
        need: Counter[MemoryRegion] = Counter(regions)
        for r, n in need.items():
            if self._counts[r] < n:
                raise TransportError(f"cannot unregister {r}: it is not registered")
        gone = []
        for r in regions:
            self._counts[r] -= 1
            self._total -= 1
            if self._counts[r] == 0:
                del self._counts[r]
                gone.append(r)
                self._span_removed(r.address, r.end)
        return gone

    def _span_added(self, start: int, end: int) -> None:
        """Merge a new distinct region's span into the merged spans it overlaps or abuts."""
        self._span_regions[(start, end)] += 1
        if self._span_regions[(start, end)] > 1:
            return  # the same span on another device: covered already
        bisect.insort(self._spans, (start, end))
        starts, ends = self._starts, self._ends
        first = bisect.bisect_left(ends, start)  # merged spans before it end short of it
        past = bisect.bisect_right(starts, end)  # merged spans from here start past it
        if first < past:
            start, end = min(start, starts[first]), max(end, ends[past - 1])
        starts[first:past] = [start]
        ends[first:past] = [end]

    def _span_removed(self, start: int, end: int) -> None:
        """Re-merge the one merged span that held a region now gone. Only ``[start, end)`` can have lost coverage
        (what the rest of the span covered, other regions still cover), so only the distinct spans that start
        before ``end`` in it are looked at: for slices of one buffer freed in order, none."""
        left = self._span_regions[(start, end)] - 1
        if left:
            self._span_regions[(start, end)] = left
            return
        del self._span_regions[(start, end)]
        spans = self._spans
        del spans[bisect.bisect_left(spans, (start, end))]
        i = bisect.bisect_right(self._starts, start) - 1
        first, last = self._starts[i], self._ends[i]
        lo = bisect.bisect_left(spans, (first,))  # (s,) sorts before every (s, e)
        hi = bisect.bisect_left(spans, (end,))  # the distinct spans of the merged one that start before `end`
        starts: list[int] = [first] if first < start else []
        ends: list[int] = [start] if first < start else []
        for a, b in spans[lo:hi]:  # sorted by start; each clipped to [start, end)
            if b <= start:
                continue
            s, e = max(a, start), min(b, end)
            if ends and s <= ends[-1]:
                ends[-1] = max(ends[-1], e)
            else:
                starts.append(s)
                ends.append(e)
        if end < last:  # still covered by the regions that covered it
            if ends and end <= ends[-1]:
                ends[-1] = last
            else:
                starts.append(end)
                ends.append(last)
        self._starts[i:i + 1] = starts
        self._ends[i:i + 1] = ends

    def covers(self, address: int, length: int) -> bool:
        """True if ``[address, address + length)`` lies inside registered memory."""
        if length <= 0:
            return False
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and address + length <= self._ends[i]

    def check(self, address: int, length: int, what: str) -> None:
        """Raise ``TransportError`` unless the span is covered."""
        if not self.covers(address, length):
            raise TransportError(
                f"{what} [{address:#x}, +{length}) is outside every registered region "
                f"({len(self._starts)} registered spans)"
            )


class Link(ABC):
    """A connection to one peer's registered memory, for one-directional writes."""

    @property
    @abstractmethod
    def peer(self) -> str:
        """A human-readable name of the peer, for error messages and logs."""

    @abstractmethod
    async def write(self, ops: Sequence[WriteOp]) -> None:
        """Write every op; return only when all bytes are visible at the destination."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release the link; later writes raise ``TransportError``."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class Transport(ABC):
    """One endpoint of a transport: owns registered memory and opens links to peers.

    Plugins subclass this and are found by name through the ``aioembed.transports``
    entry-point group; the entry point names the subclass.
    """

    name: ClassVar[str]
    capabilities: TransportCapabilities = TransportCapabilities()
    """What this transport can do; a class attribute for plugins, an instance attribute for
    configurable ones such as :class:`~aioembed.testing.MockTransport`."""

    @classmethod
    @abstractmethod
    async def open(cls, options: Mapping[str, Any]) -> Self:
        """Create and start an endpoint; ``options`` come from ``TransferConfig.transport_options``.

        Unknown or invalid options raise :class:`~aioembed.errors.ConfigError`.
        """

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Raise :class:`~aioembed.errors.ConfigError` for options :meth:`open` would refuse, without opening
        anything: no engine, no listener, no peer (reading local facts such as the host's RDMA devices is fine).

        :func:`~aioembed.transports.registry.check_transport_options` runs it where a config is loaded (``aioembed
        demo`` and ``bench``), so a misspelt option is refused before anything is printed or measured, not once
        the endpoint opens. A plugin implements it with the parsing its ``open()`` uses, never a second copy of
        the rules (which would drift). The default accepts anything: ``open()`` still checks."""
        del options

    @abstractmethod
    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Make regions usable as write sources and (once in a descriptor) destinations."""

    @abstractmethod
    async def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        """Undo one ``register`` of each region.

        Later writes into them are refused, but a plugin need not stop a peer's write already under way
        into them (UCX's posted receives, an RDMA write in flight): the caller unregisters memory only
        once no write may still reach it, as the sessions do (the pool stays registered while it lives).
        """

    @abstractmethod
    def descriptor(self) -> bytes:
        """Opaque blob a peer passes to ``connect``; lists the regions registered now."""

    @abstractmethod
    async def connect(self, peer_descriptor: bytes) -> Link:
        """Open a link that writes into the peer's announced regions.

        A descriptor that is not one of this transport's raises ``TransportError``.
        """

    def reads_unregistered(self, device: str) -> bool:
        """Whether this endpoint's writes may read *source* memory on ``device`` (``"cpu"``, ``"cuda:0"``) that
        was never registered: its engine reads it as any memory of the process (Mooncake over TCP, and UCX where
        it has no RDMA transport to use, read CPU sources so). The sender then writes straight from the caller's
        tensors on that device: no staging copy, no registration per ``send()``. Destinations are always
        registered. The answer must not change while the endpoint lives (a sender decides at start whether it
        needs a staging area), and the method must not raise. False by default."""
        return False

    @property
    def write_lifetime(self) -> float:
        """See :attr:`TransportCapabilities.write_lifetime` (this endpoint's value)."""
        return self.capabilities.write_lifetime

    @property
    def orphan_lifetime(self) -> float:
        """See :attr:`TransportCapabilities.orphan_lifetime` (this endpoint's value)."""
        return self.capabilities.orphan_lifetime

    @property
    def writer_id(self) -> str:
        """This endpoint's identity as a writer, as a peer's :meth:`revoke` knows it ("" if none)."""
        return ""

    async def revoke(self, writer_id: str) -> None:
        """Cut off every link ``writer_id`` opened to this endpoint so far: once this returns, nothing
        lands through them any more (writes posted earlier included). Links it opens later work.

        Returns once writes already landing through them have ended. Only for ``capabilities.revocable``.
        "Later" is from the call on, not from its return: a receiver revokes a lost session's writer and shakes
        hands again at once, and the same sender process (the same writer id) opens the next session's link while
        the revocation may still wait; that link must work, and its writes need not be waited for.
        """
        raise TransportError(f"transport {self.name!r} cannot revoke a writer (capabilities.revocable is false)")

    @abstractmethod
    async def aclose(self) -> None:
        """Close links, unregister everything, release native resources. Idempotent: a call made while
        another is under way returns once that one finished (:class:`~aioembed.transports.close_once.CloseOnce`
        does this for the bundled transports)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
