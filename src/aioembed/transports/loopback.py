"""In-process transport: real byte copies between regions registered in one process.

It exists so that the whole stack (protocol, sessions, pools, resume) runs on a laptop with
no GPU or NIC, with the same checks as a real transport: writes must stay inside registered
memory on both sides, and a closed peer fails writes. CPU memory only.

It can revoke a writer (``revoke(writer_id)``): every link that writer opened to this endpoint so
far is cut off for good (nothing more lands through it, not even writes posted earlier), while
links it opens later work. Writes may run on another thread's event loop than the owner's (tests
put two sides on two loops), so the bookkeeping is guarded by a lock, and ``revoke`` waits for
writes already landing, in a worker thread.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import uuid
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

import anyio
import msgpack

from aioembed.errors import ConfigError, TransportError
from aioembed.transports.base import (
    Link,
    MemoryRegion,
    RegionSet,
    Transport,
    TransportCapabilities,
    WriteOp,
)
from aioembed.transports.close_once import CloseOnce
from aioembed.transports.option_names import refuse_unknown_options

__all__ = ["LoopbackLink", "LoopbackTransport"]

_ENDPOINTS: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()

_OPTIONS = {"inline_bytes", "threads", "unregistered_sources"}


def _parse_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The endpoint's keyword arguments from ``transport_options`` (what :meth:`LoopbackTransport.open` and
    :meth:`~LoopbackTransport.check_options` both check); ``ConfigError`` naming the option otherwise."""
    if not isinstance(options, Mapping):
        raise ConfigError(f"loopback transport_options must be a mapping, got {type(options).__name__}")
    refuse_unknown_options("loopback", options, _OPTIONS)
    inline = options.get("inline_bytes", 256 * 1024)
    threads = options.get("threads", 4)
    if not isinstance(inline, int) or isinstance(inline, bool) or inline < 0:
        raise ConfigError(f"transport_options.inline_bytes must be an int >= 0, got {inline!r}")
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 256:
        raise ConfigError(f"transport_options.threads must be an int in [1, 256], got {threads!r}")
    unregistered = options.get("unregistered_sources", False)
    if not isinstance(unregistered, bool):
        raise ConfigError(f"transport_options.unregistered_sources must be true or false, got {unregistered!r}")
    return {"inline_bytes": inline, "threads": threads, "unregistered_sources": unregistered}


def _copy_all(ops: Sequence[WriteOp]) -> None:
    move = ctypes.memmove
    for op in ops:
        move(op.dst, op.src, op.length)


class LoopbackTransport(Transport):
    """Endpoint of the loopback transport.

    Options: ``inline_bytes`` (writes smaller than this copy on the event loop thread;
    larger ones in a worker thread, default 256 KiB), ``threads`` (worker threads, default 4) and
    ``unregistered_sources`` (default false: writes read CPU sources that were never registered, as
    Mooncake over TCP and UCX without RDMA do; see :meth:`Transport.reads_unregistered`, for tests of that path).
    """

    name: ClassVar[str] = "loopback"
    capabilities = TransportCapabilities(
        cuda=False, asyncio_only=False, cross_process=False, revocable=True, write_lifetime=0.0,
    )

    def __init__(self, *, inline_bytes: int = 256 * 1024, threads: int = 4, unregistered_sources: bool = False) -> None:
        self.id = uuid.uuid4().hex
        self.unregistered_sources = unregistered_sources
        self.regions = RegionSet()
        self.closed = False
        self._closing = CloseOnce()
        self._inline_bytes = inline_bytes
        self._limiter = anyio.CapacityLimiter(threads)
        self._links: set[LoopbackLink] = set()
        # Revocation, as the owner of memory: writer id -> revocations so far, and writes landing now.
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)
        self._generation: dict[str, int] = {}
        # (writer, generation of its link) -> writes landing now: a revoke waits only for the links it cuts, not
        # for those the writer opened after it (a new session's, busy at once, could hold it back for good).
        self._landing: Counter[tuple[str, int]] = Counter()
        self._writing = 0  # as a writer: writes of this endpoint's links under way (aclose() waits for them)
        _ENDPOINTS[self.id] = self

    @property
    def writer_id(self) -> str:
        return self.id

    def _admit(self, writer: str) -> int:
        """The revocation generation a link opened now by ``writer`` belongs to."""
        with self._lock:
            return self._generation.get(writer, 0)

    def _begin_landing(self, writer: str, generation: int) -> bool:
        """May a write through a link of ``writer`` opened in ``generation`` land now? (Counted until
        ``_end_landing``.)"""
        with self._lock:
            if self.closed or self._generation.get(writer, 0) != generation:
                return False
            self._landing[writer, generation] += 1
            return True

    def _end_landing(self, writer: str, generation: int) -> None:
        """A landing that ``_begin_landing(writer, generation)`` admitted ended."""
        with self._lock:
            key = (writer, generation)
            self._landing[key] -= 1
            if self._landing[key] <= 0:
                del self._landing[key]
                self._quiet.notify_all()

    def _landing_before(self, writer: str, generation: int) -> bool:
        """Is a write of ``writer`` through a link of a generation before ``generation`` landing? (Lock held.)"""
        return any(w == writer and g < generation for w, g in self._landing)

    def _wait_quiet(self, writer: str, generation: int) -> None:
        with self._lock:
            while self._landing_before(writer, generation):
                self._quiet.wait()

    async def revoke(self, writer_id: str) -> None:
        with self._lock:
            if writer_id in _ENDPOINTS:  # one that closed starts no write again: nothing to keep for it (see _close)
                # Links it opens from now on are of the new generation: not cut off, nor waited for.
                cut = self._generation[writer_id] = self._generation.get(writer_id, 0) + 1
            else:
                cut = sys.maxsize  # closed: whatever of it still lands, through any link
            busy = self._landing_before(writer_id, cut)
        if busy:
            with anyio.CancelScope(shield=True):  # the barrier must hold once revoke() started
                await anyio.to_thread.run_sync(self._wait_quiet, writer_id, cut)
        else:
            await anyio.lowlevel.checkpoint()

    @classmethod
    async def open(cls, options: Mapping[str, Any]) -> Self:
        parsed = _parse_options(options)
        await anyio.lowlevel.checkpoint()
        return cls(**parsed)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        _parse_options(options)

    def reads_unregistered(self, device: str) -> bool:
        return self.unregistered_sources and device == "cpu"

    def _check_open(self) -> None:
        if self.closed:
            raise TransportError(f"loopback endpoint {self.id[:8]} is closed")

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        await anyio.lowlevel.checkpoint_if_cancelled()  # cancel before, never after, the change
        self._check_open()
        for r in regions:
            if r.device != "cpu":
                raise TransportError(f"loopback transport supports CPU memory only, got {r}")
        self.regions.add(regions)
        await anyio.lowlevel.cancel_shielded_checkpoint()

    async def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        self.regions.remove(regions)
        await anyio.lowlevel.cancel_shielded_checkpoint()

    def descriptor(self) -> bytes:
        self._check_open()
        return msgpack.packb(
            {
                "transport": self.name,
                "endpoint": self.id,
                "pid": os.getpid(),
                "regions": [[r.address, r.length] for r in self.regions],
            }
        )

    async def connect(self, peer_descriptor: bytes) -> LoopbackLink:
        self._check_open()
        try:
            desc = msgpack.unpackb(peer_descriptor, raw=False)
            if not isinstance(desc, dict) or desc.get("transport") != self.name:
                raise ValueError("not a loopback descriptor")
            endpoint, pid, regions = desc["endpoint"], desc["pid"], desc["regions"]
            announced = RegionSet(MemoryRegion(int(a), int(n)) for a, n in regions)
        except Exception as exc:
            raise TransportError(f"bad loopback descriptor ({len(peer_descriptor)} bytes): {exc}") from exc
        if pid != os.getpid():
            raise TransportError(
                f"loopback peer lives in process {pid}, this is process {os.getpid()}: "
                "the loopback transport only works inside one process; choose mooncake or ucx"
            )
        peer = _ENDPOINTS.get(endpoint)
        if peer is None or peer.closed:
            raise TransportError(f"loopback peer {str(endpoint)[:8]} is gone")
        await anyio.lowlevel.checkpoint()
        link = LoopbackLink(self, peer, announced, peer._admit(self.id))
        self._links.add(link)
        return link

    async def aclose(self) -> None:
        await self._closing.run(self._close)

    async def _close(self) -> None:
        with self._lock:
            self.closed = True  # refuses every later landing into our memory
            busy = bool(self._landing)
        for link in list(self._links):
            await link.aclose()
        with self._lock:
            writing = self._writing > 0
        if busy or writing:
            # Writes landing in our memory right now end before it may be released; so do our own writes under
            # way (a worker thread still copying from our sources), before the caller frees those.
            await anyio.to_thread.run_sync(self._wait_all_quiet)
        _ENDPOINTS.pop(self.id, None)
        # Closed, this endpoint starts no write again (its links refuse before they land anything), so the other
        # endpoints' revocations of it have nothing left to refuse: dropped, or an owner that outlives many
        # writers would keep one entry per writer it ever revoked.
        for owner in list(_ENDPOINTS.values()):
            with owner._lock:
                owner._generation.pop(self.id, None)

    def _wait_all_quiet(self) -> None:
        with self._lock:
            while self._landing or self._writing:
                self._quiet.wait()

    def _write_started(self) -> bool:
        """Count a write of ours under way; False (nothing counted) once this endpoint is closing."""
        with self._lock:
            if self.closed:
                return False
            self._writing += 1
            return True

    def _write_ended(self) -> None:
        with self._lock:
            self._writing -= 1
            if not self._writing:
                self._quiet.notify_all()


class LoopbackLink(Link):
    """A link to another loopback endpoint in this process."""

    def __init__(self, local: LoopbackTransport, peer: LoopbackTransport, announced: RegionSet,
                 generation: int) -> None:
        self._local = local
        self._peer = peer
        self._announced = announced
        self._generation = generation
        self._closed = False

    @property
    def peer(self) -> str:
        return f"loopback:{self._peer.id[:8]}"

    async def write(self, ops: Sequence[WriteOp]) -> None:
        if self._closed or self._local.closed:
            raise TransportError(f"write on a closed link to {self.peer}")
        if self._peer.closed:
            raise TransportError(f"peer {self.peer} has closed; {len(ops)} ops not written")
        total = self._check(ops)
        await self._land(ops, total, self._generation)

    def _check(self, ops: Sequence[WriteOp]) -> int:
        """Validate every op before anything moves; returns the byte count."""
        total = 0
        for op in ops:
            if op.length <= 0:
                raise TransportError(f"write op with non-positive length: {op}")
            if not self._local.unregistered_sources:
                self._local.regions.check(op.src, op.length, "write source")
            self._announced.check(op.dst, op.length, f"write destination at {self.peer}")
            self._peer.regions.check(op.dst, op.length, f"write destination at {self.peer}")
            total += op.length
        return total

    async def _land(self, ops: Sequence[WriteOp], total: int, generation: int) -> None:
        """Move the bytes, unless the owner revoked this writer since ``generation``."""
        writer = self._local.id
        if not self._local._write_started():  # closed meanwhile (a write that waited first, as a mock's may)
            raise TransportError(f"write of {total} bytes to {self.peer} refused: this endpoint closed",
                                 may_land=False)
        try:
            if not self._peer._begin_landing(writer, generation):
                raise TransportError(f"write of {total} bytes to {self.peer} refused: the peer revoked this link "
                                     "or closed", may_land=False)
            try:
                await self._copy(ops, total)
            finally:
                self._peer._end_landing(writer, generation)
        finally:
            self._local._write_ended()

    async def _copy(self, ops: Sequence[WriteOp], total: int) -> None:
        if total <= self._local._inline_bytes:
            _copy_all(ops)
            await anyio.lowlevel.checkpoint()
            return
        # Large writes go to the worker threads in about equal parts (bandwidth shared across cores).
        limiter = self._local._limiter
        parts = max(1, min(int(limiter.total_tokens), total // (4 << 20)))
        share = -(-total // parts)
        chunks: list[list[WriteOp]] = [[] for _ in range(parts)]
        done = 0
        for op in ops:
            off = 0
            while off < op.length:
                i = done // share
                n = min(op.length - off, (i + 1) * share - done)
                chunks[i].append(WriteOp(op.src + off, op.dst + off, n))
                off += n
                done += n
        async with anyio.create_task_group() as tg:
            for chunk in chunks:
                tg.start_soon(functools.partial(anyio.to_thread.run_sync, _copy_all, chunk, limiter=limiter))

    async def aclose(self) -> None:
        self._closed = True
        self._local._links.discard(self)
        await anyio.lowlevel.checkpoint()
