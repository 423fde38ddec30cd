"""``MockTransport``: a fault-injecting in-process transport for tests (yours and ours).

It moves real bytes like the loopback transport, and lets a test decide, per write, what goes
wrong: a delay before the bytes land, an exception (any type, as a native engine would raise),
and a *late landing*, where the bytes still arrive some time after the write failed or was
cancelled, as with an RDMA engine or a socket buffer. Its capabilities are set per instance:
cancel-safe or not, revocable or not, and the write lifetime it declares.

Late landings run on a timer thread, not on an event loop, so they land while the receiving
loop is frozen, exactly like a NIC writing into a stopped process. A write's source bytes are
read when the write is posted (a snapshot), so a late landing never reads freed memory.

Inject it with ``EmbeddingSender(..., transport=MockTransport(...))`` and
``EmbeddingReceiver(..., transport=MockTransport(...))`` (both sides must use ``mock``)::

    def faults(call: WriteCall) -> WriteFault | None:
        if call.index == 0:
            return WriteFault(error=RuntimeError("engine says no"), land_after=0.5)
        return None

    sender_transport = MockTransport(cancel_safe_writes=False, write_lifetime=1.0, faults=faults)
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import anyio

from aioembed.errors import TransportError
from aioembed.transports.base import TransportCapabilities, WriteOp
from aioembed.transports.loopback import LoopbackLink, LoopbackTransport
from aioembed.transports.option_names import refuse_unknown_options

__all__ = ["MockTransport", "WriteCall", "WriteFault"]


@dataclass(frozen=True, slots=True)
class WriteCall:
    """What a fault policy knows about a write."""

    index: int
    """0 for this endpoint's first write, then 1, 2, ..."""
    peer: str
    """The destination endpoint's name."""
    nbytes: int
    ops: tuple[WriteOp, ...]


@dataclass(slots=True)
class WriteFault:
    """What happens to one write. All times in seconds from the call."""

    delay: float = 0.0
    """Before the bytes land and the write returns (a slow link)."""
    error: BaseException | None = None
    """Raise this instead of completing (after ``fail_after``)."""
    fail_after: float = 0.0
    land_after: float | None = None
    """With ``error`` (or a cancelled write): the bytes still land this long after the call,
    unless the destination revoked the writer first. ``None``: they never land."""
    landed: threading.Event = field(default_factory=threading.Event)
    """Set once the bytes landed (promptly or late)."""
    refused: threading.Event = field(default_factory=threading.Event)
    """Set if a late landing was refused (revoked writer, closed destination)."""


FaultPolicy = Callable[[WriteCall], "WriteFault | None"]


class MockTransport(LoopbackTransport):
    """An in-process transport with scripted faults; CPU memory, one process.

    ``raise_on`` maps a method name (``register``, ``unregister``, ``connect``, ``write``,
    ``descriptor``, ``revoke``, ``aclose``) to an exception it raises on every call, until the
    test removes it. ``faults`` is called for every write. ``landings`` counts bytes landed.
    """

    name: ClassVar[str] = "mock"

    def __init__(self, *, cancel_safe_writes: bool = True, revocable: bool = False, write_lifetime: float = 0.0,
                 orphan_lifetime: float | None = None, faults: FaultPolicy | None = None,
                 raise_on: Mapping[str, BaseException] | None = None, inline_bytes: int = 256 * 1024,
                 threads: int = 4, unregistered_sources: bool = False) -> None:
        super().__init__(inline_bytes=inline_bytes, threads=threads, unregistered_sources=unregistered_sources)
        self.capabilities = TransportCapabilities(
            cuda=False, asyncio_only=False, cross_process=False, cancel_safe_writes=cancel_safe_writes,
            revocable=revocable, write_lifetime=write_lifetime,
            orphan_lifetime=write_lifetime if orphan_lifetime is None else orphan_lifetime,
        )
        self.faults = faults
        self.raise_on: dict[str, BaseException] = dict(raise_on or {})
        self.calls = itertools.count()
        self.late: list[WriteFault] = []
        self._timers: set[threading.Timer] = set()

    @classmethod
    async def open(cls, options: Mapping[str, Any]) -> Self:
        known = {"cancel_safe_writes", "revocable", "write_lifetime", "orphan_lifetime", "inline_bytes", "threads",
                 "unregistered_sources"}
        refuse_unknown_options("mock", options, known)
        await anyio.lowlevel.checkpoint()
        return cls(**dict(options))

    def _maybe_raise(self, method: str) -> None:
        exc = self.raise_on.get(method)
        if exc is not None:
            raise exc

    async def register(self, regions: Any) -> None:
        self._maybe_raise("register")
        await super().register(regions)

    async def unregister(self, regions: Any) -> None:
        self._maybe_raise("unregister")
        await super().unregister(regions)

    def descriptor(self) -> bytes:
        self._maybe_raise("descriptor")
        return super().descriptor()

    async def connect(self, peer_descriptor: bytes) -> MockLink:
        self._maybe_raise("connect")
        link = await super().connect(peer_descriptor)
        mock = MockLink(self, link._peer, link._announced, link._generation)
        self._links.discard(link)
        self._links.add(mock)
        return mock

    async def revoke(self, writer_id: str) -> None:
        self._maybe_raise("revoke")
        if not self.capabilities.revocable:
            raise TransportError("this MockTransport was made with revocable=False")
        await super().revoke(writer_id)

    async def aclose(self) -> None:
        # Late landings keep their appointment (as a real data plane would); closing the
        # destination endpoint refuses them.
        exc = self.raise_on.get("aclose")
        await super().aclose()
        if exc is not None:
            raise exc

    def _schedule_late(self, link: MockLink, ops: list[tuple[int, bytes]], generation: int, fault: WriteFault,
                       at: float) -> None:
        peer, writer = link._peer, self.id

        def land() -> None:
            self._timers.discard(timer)
            if not peer._begin_landing(writer, generation):
                fault.refused.set()
                return
            try:
                for dst, data in ops:
                    ctypes.memmove(dst, data, len(data))
            finally:
                peer._end_landing(writer, generation)
            fault.landed.set()

        timer = threading.Timer(max(0.0, at - time.monotonic()), land)
        timer.daemon = True
        self._timers.add(timer)
        self.late.append(fault)
        timer.start()


class MockLink(LoopbackLink):
    """A loopback link whose writes follow the transport's fault policy."""

    _local: MockTransport

    async def write(self, ops: Sequence[WriteOp]) -> None:
        local = self._local
        local._maybe_raise("write")
        if self._closed or local.closed:
            raise TransportError(f"write on a closed link to {self.peer}")
        if self._peer.closed:
            raise TransportError(f"peer {self.peer} has closed; {len(ops)} ops not written")
        generation = self._generation
        total = self._check(ops)
        call = WriteCall(next(local.calls), self.peer, total, tuple(ops))
        fault = local.faults(call) if local.faults is not None else None
        if fault is None:
            await self._land(ops, total, generation)
            return
        posted = time.monotonic()
        snapshot = [(op.dst, ctypes.string_at(op.src, op.length)) for op in ops]
        try:
            if fault.error is not None:
                await anyio.sleep(fault.fail_after)
                raise fault.error
            await anyio.sleep(fault.delay)
            await self._land(ops, total, generation)
            fault.landed.set()
        except BaseException:
            if fault.land_after is not None and not fault.landed.is_set():
                local._schedule_late(self, snapshot, generation, fault, posted + fault.land_after)
            raise
