"""Deliberately broken transport plugins: each one is wrong in a way that breaks block ownership.

Every class here passed the conformance suite as it was before the checks in
``test_conformance_catches_broken_plugins.py`` were added (see that module). Each one is built on the
loopback or mock transport and changes one thing; :class:`SlowLoopbackTransport` is the honest slow
plugin the broken ones start from (writes of 1 MiB or more copy in slices from a worker thread, so that
a write is still moving when a test cancels, revokes or closes around it).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

import anyio

from aioembed.errors import TransportError
from aioembed.testing.mock import MockTransport, WriteCall, WriteFault
from aioembed.transports.base import RegionSet, TransportCapabilities, WriteOp
from aioembed.transports.loopback import LoopbackLink, LoopbackTransport

BIG = 1 << 20
"""Writes from this size on are the slow / faulty ones; smaller ones behave like loopback's."""


def _slow_copy(ops: Sequence[WriteOp], pieces: int = 16, pause: float = 0.02) -> None:
    """Copy ``ops`` in ``pieces`` slices, pausing between them (a slow engine in its own thread)."""
    total = sum(op.length for op in ops)
    step = max(1, -(-total // pieces))
    for op in ops:
        off = 0
        while off < op.length:
            n = min(step, op.length - off)
            ctypes.memmove(op.dst + off, op.src + off, n)
            off += n
            time.sleep(pause)


class SlowLink(LoopbackLink):
    _local: SlowLoopbackTransport

    async def _copy(self, ops: Sequence[WriteOp], total: int) -> None:
        if total < BIG:
            await super()._copy(ops, total)
            return
        await anyio.to_thread.run_sync(_slow_copy, list(ops))


class SlowLoopbackTransport(LoopbackTransport):
    """Honest: loopback whose large writes take about a third of a second (16 slices, 20 ms apart)."""

    name: ClassVar[str] = "slow-loopback"
    link_class: ClassVar[type[LoopbackLink]] = SlowLink

    async def connect(self, peer_descriptor: bytes) -> LoopbackLink:
        link = await super().connect(peer_descriptor)
        slow = self.link_class(self, link._peer, link._announced, link._generation)
        self._links.discard(link)
        self._links.add(slow)
        return slow


# -- 1. cancel_safe_writes=True, but a cancelled write still lands later ---------------------------------


def _late_if_cancelled(call: WriteCall) -> WriteFault | None:
    """Large writes take 0.25 s; one cancelled meanwhile still lands 0.4 s after it was posted."""
    return WriteFault(delay=0.25, land_after=0.4) if call.nbytes >= BIG else None


class CancelLandsLaterTransport(MockTransport):
    """Declares ``cancel_safe_writes=True`` (the default) but a cancelled write lands 0.4 s later."""

    name: ClassVar[str] = "broken-cancel-safe"

    @classmethod
    async def open(cls, options: Mapping[str, Any]) -> Self:
        await anyio.lowlevel.checkpoint()
        if options:
            from aioembed.errors import ConfigError
            raise ConfigError(f"unknown options {sorted(options)}")
        return cls(cancel_safe_writes=True, faults=_late_if_cancelled)


# -- 2. write_lifetime shorter than real -----------------------------------------------------------------


class ShortLifetimeTransport(MockTransport):
    """Honest about ``cancel_safe_writes=False`` but declares a write lifetime of 50 ms for writes that land
    0.4 s after they were posted."""

    name: ClassVar[str] = "broken-lifetime"
    lifetime: ClassVar[float] = 0.05

    @classmethod
    async def open(cls, options: Mapping[str, Any]) -> Self:
        await anyio.lowlevel.checkpoint()
        if options:
            from aioembed.errors import ConfigError
            raise ConfigError(f"unknown options {sorted(options)}")
        return cls(cancel_safe_writes=False, write_lifetime=cls.lifetime, faults=_late_if_cancelled)


class HonestLifetimeTransport(ShortLifetimeTransport):
    """The control: the same late landings, a write lifetime that covers them."""

    name: ClassVar[str] = "honest-lifetime"
    lifetime: ClassVar[float] = 1.0


# -- 3. revoke() returns before writes already landing have stopped ---------------------------------------


class RevokeNoWaitTransport(SlowLoopbackTransport):
    """``revoke()`` refuses new landings but returns at once: a write already copying goes on."""

    name: ClassVar[str] = "broken-revoke"

    async def revoke(self, writer_id: str) -> None:
        with self._lock:
            self._generation[writer_id] = self._generation.get(writer_id, 0) + 1
        await anyio.lowlevel.checkpoint()


# -- 4. aclose() returns with writes still moving (as the owner of the memory, and as the writer) ---------


class CloseNoWaitTransport(SlowLoopbackTransport):
    """``aclose()`` marks the endpoint closed and returns: writes landing in its memory go on."""

    name: ClassVar[str] = "broken-close"

    def _wait_all_quiet(self) -> None:
        return None


# -- 5. a refused write that moved part of its bytes first -----------------------------------------------


class PartialRefusalLink(LoopbackLink):
    async def write(self, ops: Sequence[WriteOp]) -> None:
        if self._closed or self._local.closed:
            raise TransportError(f"write on a closed link to {self.peer}")
        if self._peer.closed:
            raise TransportError(f"peer {self.peer} has closed")
        writer = self._local.id
        if not self._peer._begin_landing(writer, self._generation):
            raise TransportError(f"write to {self.peer} refused: revoked", may_land=False)
        try:
            for op in ops:  # checks each op just before copying it: the ops before a bad one have landed
                self._check([op])
                ctypes.memmove(op.dst, op.src, op.length)
        finally:
            self._peer._end_landing(writer, self._generation)
        await anyio.lowlevel.checkpoint()


class PartialRefusalTransport(SlowLoopbackTransport):
    name: ClassVar[str] = "broken-partial"
    link_class = PartialRefusalLink


# -- 6. writes landing outside the registered regions (between two of them) ------------------------------


class BoundingBoxLink(LoopbackLink):
    def _check(self, ops: Sequence[WriteOp]) -> int:
        regions = list(self._announced)
        lo, hi = min(r.address for r in regions), max(r.end for r in regions)
        total = 0
        for op in ops:
            if op.length <= 0:
                raise TransportError("non-positive length")
            if not self._local.unregistered_sources:
                self._local.regions.check(op.src, op.length, "write source")
            if not (lo <= op.dst and op.dst + op.length <= hi):  # the span of the regions, not the regions
                raise TransportError("write destination outside the announced regions")
            total += op.length
        return total


class BoundingBoxTransport(SlowLoopbackTransport):
    name: ClassVar[str] = "broken-bounds"
    link_class = BoundingBoxLink


# -- 7. reads_unregistered() says yes for memory it reads the wrong way ----------------------------------


class ReadsAnyDeviceTransport(LoopbackTransport):
    """Reads unregistered CPU sources (honestly), but answers true for CUDA devices too, while it reads every
    address as host memory (``capabilities.cuda`` is false): a sender would hand it device pointers."""

    name: ClassVar[str] = "broken-reads-unregistered"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**{**kw, "unregistered_sources": True})

    def reads_unregistered(self, device: str) -> bool:
        return True


class FlippingReadsUnregisteredTransport(LoopbackTransport):
    """Answers ``reads_unregistered("cpu")`` true only once something is registered (the sender asks once, at
    start: it then stages nothing, and reads its caller's tensors from an endpoint whose answer changes)."""

    name: ClassVar[str] = "broken-reads-flips"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**{**kw, "unregistered_sources": True})

    def reads_unregistered(self, device: str) -> bool:
        return device == "cpu" and len(self.regions) > 0


# -- 8. settled() that returns before the failed write's last bytes landed --------------------------------


class EarlySettledLink(LoopbackLink):
    """Large writes take 0.25 s; closing the link under one fails it with ``may_land=True`` and a ``settled``
    that returns at once, while its bytes still land 0.4 s after it was posted."""

    _local: EarlySettledTransport

    async def write(self, ops: Sequence[WriteOp]) -> None:
        if self._closed or self._local.closed:
            raise TransportError(f"write on a closed link to {self.peer}")
        total = self._check(ops)
        if total < BIG:
            await self._land(ops, total, self._generation)
            return
        posted = time.monotonic()
        snapshot = [(op.dst, ctypes.string_at(op.src, op.length)) for op in ops]
        with anyio.CancelScope() as scope:
            self._local.in_flight.add(scope)
            try:
                await anyio.sleep(0.25)
            finally:
                self._local.in_flight.discard(scope)
        if not scope.cancelled_caught:
            await self._land(ops, total, self._generation)
            return
        done = threading.Event()
        peer, writer, generation = self._peer, self._local.id, self._generation

        def land() -> None:
            try:
                if not peer._begin_landing(writer, generation):  # never into a closed endpoint's memory
                    return
                try:
                    for dst, data in snapshot:
                        ctypes.memmove(dst, data, len(data))
                finally:
                    peer._end_landing(writer, generation)
            finally:
                done.set()

        timer = threading.Timer(max(0.0, posted + 0.4 - time.monotonic()), land)
        timer.daemon = True
        timer.start()
        raise TransportError("link closed under the write", may_land=True,
                             settled=self._local.settled_waiter(done))

    async def aclose(self) -> None:
        for scope in list(self._local.in_flight):
            scope.cancel()
        await super().aclose()


class EarlySettledTransport(SlowLoopbackTransport):
    name: ClassVar[str] = "broken-settled"
    link_class = EarlySettledLink
    capabilities = TransportCapabilities(cuda=False, cross_process=False, cancel_safe_writes=False,
                                         revocable=False, write_lifetime=0.05, orphan_lifetime=0.05)

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.in_flight: set[anyio.CancelScope] = set()

    def settled_waiter(self, done: threading.Event) -> Any:
        async def settled() -> None:  # returns at once: it never looks at ``done``
            await anyio.lowlevel.checkpoint()
        return settled

    async def revoke(self, writer_id: str) -> None:
        raise TransportError("not revocable")


class HonestSettledTransport(EarlySettledTransport):
    """The control: ``settled`` returns once the late bytes landed."""

    name: ClassVar[str] = "honest-settled"
    capabilities = TransportCapabilities(cuda=False, cross_process=False, cancel_safe_writes=False,
                                         revocable=False, write_lifetime=0.05, orphan_lifetime=0.5)
    """A writer closing under its writes lets them land 0.4 s later: its orphan lifetime covers that."""

    def settled_waiter(self, done: threading.Event) -> Any:
        async def settled() -> None:
            await anyio.to_thread.run_sync(done.wait)
        return settled


BROKEN: dict[str, type[LoopbackTransport]] = {
    cls.name: cls
    for cls in (CancelLandsLaterTransport, ShortLifetimeTransport, RevokeNoWaitTransport, CloseNoWaitTransport,
                PartialRefusalTransport, BoundingBoxTransport, ReadsAnyDeviceTransport,
                FlippingReadsUnregisteredTransport, EarlySettledTransport)
}
"""Each broken plugin: passed the suite before, fails it now."""

HONEST: dict[str, type[LoopbackTransport]] = {
    cls.name: cls for cls in (SlowLoopbackTransport, HonestLifetimeTransport, HonestSettledTransport)
}
"""Controls: built like the broken ones, right where they are wrong; they pass the new checks."""

__all__ = ["BROKEN", "HONEST", "RegionSet"]
