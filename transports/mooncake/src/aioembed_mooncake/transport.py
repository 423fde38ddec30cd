"""The ``mooncake`` transport: aioembed's Transport / Link on Mooncake's ``TransferEngine``.

Every engine call blocks (initialization, registration, and writes, which also busy-spin in
native code with the GIL released), so each runs in a worker thread through
``anyio.to_thread``; the transport therefore works under asyncio and trio alike. Writes go
through a ``CapacityLimiter`` of ``threads`` tokens.

Failure semantics (see the README): a write that fails or times out is *not* cancelled by the
engine. Its bytes may still land at the destination later, and its source may still be read.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

import anyio
import anyio.to_thread
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

from aioembed_mooncake._engine import (
    EngineSettings,
    cuda_build_installed,
    destroy_engine,
    load_engine_module,
    rdma_devices,
    start_engine,
)
from aioembed_mooncake._regions import EngineRegistrations, Piece, PieceIndex

__all__ = ["DESCRIPTOR_VERSION", "MooncakeLink", "MooncakeTransport", "default_hostname"]

log = logging.getLogger("aioembed_mooncake")

DESCRIPTOR_VERSION = 1

TCP_QUEUE_PER_PEER = 1024
"""Transfers the engine's TCP transport queues per peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``).

Past this (plus 1024 waiting admissions) it fails transfers at once (``queue-full``). The
default ``max_batch_ops`` keeps ``threads * max_batch_ops <= TCP_QUEUE_PER_PEER``, so the ops
in flight from one endpoint never exceed the queue.
"""

_OPTIONS = (
    "protocol", "device_name", "hostname", "metadata_server", "threads",
    "max_batch_bytes", "max_batch_ops", "transfer_timeout",
)
_PROTOCOLS = ("auto", "rdma", "tcp")
_HOST_RE = re.compile(r"^[A-Za-z0-9._-]+$")


def default_hostname() -> str:
    """The address to advertise when ``hostname`` is not set.

    The IPv4 address of the interface that routes outward (a UDP ``connect`` sends no packet),
    else the address ``gethostname()`` resolves to unless it is loopback, else ``127.0.0.1``.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addr = str(s.getsockname()[0])
            if addr and not addr.startswith(("0.", "127.")):
                return addr
    except OSError:
        pass
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    return "127.0.0.1"


def _opt_int(options: Mapping[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    v = options.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ConfigError(f"transport_options.{name} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _opt_str(options: Mapping[str, Any], name: str, default: str) -> str:
    v = options.get(name, default)
    if not isinstance(v, str):
        raise ConfigError(f"transport_options.{name} must be a string, got {v!r}")
    return v


class _Config:
    """Validated options of one endpoint."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        if not isinstance(options, Mapping):
            raise ConfigError(f"mooncake transport_options must be a table/mapping, got {options!r}")
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown mooncake transport option(s) {unknown}; known: {sorted(_OPTIONS)}")

        protocol = _opt_str(options, "protocol", "auto")
        if protocol not in _PROTOCOLS:
            raise ConfigError(f"transport_options.protocol={protocol!r}; allowed: {', '.join(map(repr, _PROTOCOLS))}")

        raw_dev = options.get("device_name", "")
        if isinstance(raw_dev, str):
            devices = [d.strip() for d in raw_dev.split(",") if d.strip()]
        elif isinstance(raw_dev, (list, tuple)) and all(isinstance(d, str) and d.strip() for d in raw_dev):
            devices = [d.strip() for d in raw_dev]
        else:
            raise ConfigError(
                "transport_options.device_name must be RDMA device names, comma separated "
                f"(e.g. 'mlx5_0,mlx5_1') or a list of names, got {raw_dev!r}"
            )
        present = rdma_devices()
        missing = [d for d in devices if d not in present]
        if missing and protocol != "tcp":
            raise ConfigError(
                f"transport_options.device_name names RDMA device(s) {missing} that this host does not have; "
                f"present in /sys/class/infiniband: {present or 'none'}"
            )
        if protocol == "auto":
            protocol = "rdma" if present else "tcp"
            log.info("mooncake transport: protocol 'auto' chose %s (%s)", protocol,
                     f"RDMA devices {present}" if present else "no RDMA device in /sys/class/infiniband")
        elif protocol == "rdma" and not present:
            raise ConfigError(
                "transport_options.protocol='rdma' but this host has no RDMA device "
                "(/sys/class/infiniband is empty or missing); use protocol='tcp' or 'auto'"
            )
        if protocol == "tcp" and devices:
            log.warning("mooncake transport: device_name=%r is ignored with protocol 'tcp'", raw_dev)
            devices = []
        self.protocol = protocol
        self.device_name = ",".join(devices)

        hostname = options.get("hostname")
        if hostname is None:
            hostname = default_hostname()
            log.info("mooncake transport: advertising hostname %s (set transport_options.hostname to choose)",
                     hostname)
        if not isinstance(hostname, str) or not _HOST_RE.match(hostname):
            raise ConfigError(
                "transport_options.hostname must be a host name or IPv4 address that peers can reach, "
                f"without a port (the engine picks its own port), got {hostname!r}"
            )
        self.hostname = hostname

        metadata_server = _opt_str(options, "metadata_server", "P2PHANDSHAKE")
        if not metadata_server or (metadata_server.upper() == "P2PHANDSHAKE" and metadata_server != "P2PHANDSHAKE"):
            raise ConfigError(
                f"transport_options.metadata_server={metadata_server!r}; use 'P2PHANDSHAKE' (exactly, upper case: "
                "no metadata server needed) or a metadata server address such as 'etcd://host:2379'"
            )
        self.metadata_server = metadata_server

        self.threads = _opt_int(options, "threads", 4, 1, 256)
        self.max_batch_bytes = _opt_int(options, "max_batch_bytes", 64 << 20, 64 << 10, 1 << 34)
        self.max_batch_ops = _opt_int(options, "max_batch_ops", max(1, TCP_QUEUE_PER_PEER // self.threads),
                                      1, 1 << 16)

        timeout = options.get("transfer_timeout")
        if timeout is not None:
            if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or math.isnan(timeout)
                    or not 5 <= timeout <= 86400):
                raise ConfigError(
                    f"transport_options.transfer_timeout must be a number of seconds in [5, 86400] "
                    f"(the engine's minimum is 5), got {timeout!r}"
                )
            timeout = math.ceil(timeout)
        self.transfer_timeout: int | None = timeout

    def engine_settings(self) -> EngineSettings:
        return EngineSettings(
            hostname=self.hostname,
            metadata_server=self.metadata_server,
            protocol=self.protocol,
            device_name=self.device_name,
            transfer_timeout=self.transfer_timeout,
        )


class MooncakeTransport(Transport):
    """Endpoint of the ``mooncake`` transport: one ``TransferEngine``.

    Options (``TransferConfig.transport_options``): ``protocol`` (``auto`` | ``rdma`` | ``tcp``),
    ``device_name`` (RDMA devices, comma separated), ``hostname`` (address peers reach this
    endpoint at), ``metadata_server`` (default ``P2PHANDSHAKE``), ``threads`` (worker threads
    for writes, default 4), ``max_batch_bytes`` (default 64 MiB), ``max_batch_ops`` (default
    ``1024 // threads``) and ``transfer_timeout`` (seconds, at least 5; engine default 30).
    """

    name: ClassVar[str] = "mooncake"
    capabilities: ClassVar[TransportCapabilities] = TransportCapabilities(
        cuda=cuda_build_installed(), asyncio_only=False, cross_process=True,
        cancel_safe_writes=False,  # a timed-out write is not cancelled: its bytes may land later
    )

    def __init__(self, config: _Config, engine: Any, session: str, rpc_port: int) -> None:
        self.config = config
        self.session = session
        self.rpc_port = rpc_port
        self.closed = False
        self._engine: Any = engine
        self._reg = EngineRegistrations()
        self._reg_lock = anyio.Lock()
        self._limiter = anyio.CapacityLimiter(config.threads)
        self._links: set[MooncakeLink] = set()
        self._inflight = 0
        self._idle = anyio.Event()
        self._idle.set()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._reg.regions)} regions"
        return f"<MooncakeTransport {self.session} {self.config.protocol} {state}>"

    @property
    def regions(self) -> RegionSet:
        """The regions registered now (aioembed's refcounted view)."""
        return self._reg.regions

    @property
    def engine_pieces(self) -> list[Piece]:
        """The engine's registrations backing :attr:`regions` (disjoint spans)."""
        return self._reg.pieces

    @property
    def transfer_timeout(self) -> int:
        """Seconds after which the engine gives up on a write."""
        if self.config.transfer_timeout is not None:
            return self.config.transfer_timeout
        try:
            return max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
        except ValueError:
            return 30

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    async def open(cls, options: Mapping[str, Any]) -> Self:
        config = _Config(options)
        started = await anyio.to_thread.run_sync(start_engine, config.engine_settings())
        log.info("mooncake transport: engine up, session %s, protocol %s%s", started.session, config.protocol,
                 f", devices {config.device_name}" if config.device_name else "")
        return cls(config, started.engine, started.session, started.rpc_port)

    def _check_open(self) -> Any:
        if self.closed or self._engine is None:
            raise TransportError(f"mooncake endpoint {self.session} is closed")
        return self._engine

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            for link in list(self._links):
                link._closed = True
            self._links.clear()
            # Writes already handed to the engine cannot be cancelled: let them end (they are
            # bounded by transfer_timeout) before unregistering their memory.
            await self._idle.wait()
            async with self._reg_lock:
                pieces = self._reg.clear()
                engine = self._engine
                self._engine = None
                if pieces:
                    rc = await anyio.to_thread.run_sync(
                        engine.batch_unregister_memory, [p.start for p in pieces]
                    )
                    if rc != 0:
                        log.warning("mooncake transport: unregistering %d spans at close returned %d", len(pieces), rc)
                self._reg.forget(pieces)
            box = [engine]
            del engine
            await anyio.to_thread.run_sync(destroy_engine, box, self.rpc_port)

    # -- registration --------------------------------------------------------------------

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        engine = self._check_open()
        regions = list(regions)
        mod = load_engine_module()
        for r in regions:
            if r.device != "cpu" and not (r.device.startswith("cuda") and getattr(mod, "SUPPORT_CUDA", False)):
                raise TransportError(
                    f"mooncake transport cannot register {r}: the installed engine build has no support "
                    f"for {r.device.split(':')[0]} memory (install aioembed-mooncake[cuda12] or [cuda13])"
                )
        if not regions:
            return
        with anyio.CancelScope(shield=True):  # engine state and accounting must stay in step
            async with self._reg_lock:
                self._check_open()
                new = self._reg.plan_add(regions)
                if new:
                    rc = await anyio.to_thread.run_sync(
                        engine.batch_register_memory, [p.start for p in new], [p.length for p in new]
                    )
                    if rc != 0:
                        raise TransportError(
                            f"mooncake transport: registering {len(new)} span(s), {sum(p.length for p in new)} bytes "
                            f"(for {len(regions)} region(s)) failed: batch_register_memory returned {rc}"
                        )
                self._reg.commit_add(regions, new)

    async def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        engine = self._check_open()
        regions = list(regions)
        if not regions:
            return
        with anyio.CancelScope(shield=True):
            async with self._reg_lock:
                self._check_open()
                orphans = self._reg.remove(regions)  # raises, changing nothing, for unknown regions
                if orphans:
                    rc = await anyio.to_thread.run_sync(
                        engine.batch_unregister_memory, [p.start for p in orphans]
                    )
                    if rc != 0:
                        # Keep them recorded: they are retried on the next unregister and at close.
                        raise TransportError(
                            f"mooncake transport: unregistering {len(orphans)} span(s) failed: "
                            f"batch_unregister_memory returned {rc}"
                        )
                    self._reg.forget(orphans)

    # -- descriptor and links ------------------------------------------------------------

    def descriptor(self) -> bytes:
        self._check_open()
        return msgpack.packb(
            {
                "transport": self.name,
                "version": DESCRIPTOR_VERSION,
                "session": self.session,
                "protocol": self.config.protocol,
                "regions": [[r.address, r.length] for r in self._reg.regions],
                "segments": [[p.start, p.length] for p in self._reg.pieces],
            }
        )

    async def connect(self, peer_descriptor: bytes) -> MooncakeLink:
        engine = self._check_open()
        try:
            desc = msgpack.unpackb(peer_descriptor, raw=False)
            if not isinstance(desc, dict) or desc.get("transport") != self.name:
                raise ValueError("not a mooncake descriptor")
            if desc.get("version") != DESCRIPTOR_VERSION:
                raise ValueError(f"descriptor version {desc.get('version')!r}, this endpoint reads "
                                 f"{DESCRIPTOR_VERSION}")
            session, protocol = desc["session"], desc["protocol"]
            if not isinstance(session, str) or not session or not isinstance(protocol, str):
                raise ValueError(f"bad session {session!r} / protocol {protocol!r}")
            announced = RegionSet(_region(x) for x in desc["regions"])
            segments = PieceIndex(Piece(p.address, p.end) for p in map(_region, desc["segments"]))
            for r in announced:
                if segments.gaps(r.address, r.end):
                    raise ValueError(f"region {r} is not covered by the engine segments")
        except Exception as exc:
            raise TransportError(f"bad mooncake descriptor ({len(peer_descriptor)} bytes): {exc}") from exc
        if protocol != self.config.protocol:
            raise TransportError(
                f"mooncake peer {session} uses protocol {protocol!r}, this endpoint {self.config.protocol!r}; "
                "set the same transport_options.protocol on both sides"
            )
        probe = getattr(engine, "send_probe", None)
        if probe is not None:
            rc = await anyio.to_thread.run_sync(probe, session, abandon_on_cancel=True)
            if rc != 0:
                raise TransportError(
                    f"mooncake peer {session} is not reachable (probe returned {rc}); the peer advertises the "
                    "address in its transport_options.hostname, which must be reachable from this host"
                )
        self._check_open()
        link = MooncakeLink(self, session, announced, segments)
        self._links.add(link)
        return link

    # -- writes (called by links) --------------------------------------------------------

    def _plan(self, ops: Sequence[WriteOp], link: MooncakeLink) -> list[list[tuple[int, int, int]]]:
        """Validate ops and pack them into batches of (src, dst, length)."""
        regions = self._reg.regions
        local = self._reg.index()
        cfg = self.config
        step = cfg.max_batch_bytes
        pieces: list[tuple[int, int, int]] = []
        for op in ops:
            if op.length <= 0:
                raise TransportError(f"write op with non-positive length: {op}")
            regions.check(op.src, op.length, "write source")
            link._announced.check(op.dst, op.length, f"write destination at {link.peer}")
        for op in ops:
            cuts = set(local.cut_points(op.src, op.length))
            cuts.update(link._segments.cut_points(op.dst, op.length))
            cuts.update(range(step, op.length, step))
            bounds = [0, *sorted(cuts), op.length]
            for a, b in itertools.pairwise(bounds):
                pieces.append((op.src + a, op.dst + a, b - a))
        batches: list[list[tuple[int, int, int]]] = []
        cur: list[tuple[int, int, int]] = []
        cur_bytes = 0
        for p in pieces:
            if cur and (cur_bytes + p[2] > step or len(cur) >= cfg.max_batch_ops):
                batches.append(cur)
                cur, cur_bytes = [], 0
            cur.append(p)
            cur_bytes += p[2]
        if cur:
            batches.append(cur)
        return batches

    async def _write(self, link: MooncakeLink, ops: Sequence[WriteOp]) -> None:
        if link._closed or self.closed:
            raise TransportError(f"write on a closed link to {link.peer}")
        engine = self._check_open()
        if not ops:
            await anyio.lowlevel.checkpoint()
            return
        batches = self._plan(ops, link)
        total = sum(op.length for op in ops)
        results: list[tuple[int, int, int]] = []  # (rc, ops, bytes) of each batch
        started = time.monotonic()
        # At most half the worker threads per write: a large write cannot take every thread,
        # and the limiter queues batches first come, first served, so small writes interleave.
        per_write = anyio.CapacityLimiter(max(1, self.config.threads // 2))
        write = engine.batch_transfer_sync_write

        async def run(batch: list[tuple[int, int, int]]) -> None:
            async with per_write:
                rc = await anyio.to_thread.run_sync(
                    write, link.session, [b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch],
                    limiter=self._limiter,
                )
            results.append((int(rc), len(batch), sum(b[2] for b in batch)))

        self._inflight += 1
        if self._inflight == 1:
            self._idle = anyio.Event()
        try:
            # A batch in the engine cannot be cancelled; worker threads are never abandoned, so a
            # cancelled write returns only once its batches have ended.
            if len(batches) == 1:
                await run(batches[0])
            else:
                async with anyio.create_task_group() as tg:
                    for batch in batches:
                        tg.start_soon(run, batch)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        failed = [r for r in results if r[0] != 0]
        if failed:
            elapsed = time.monotonic() - started
            bad_ops, bad_bytes = sum(r[1] for r in failed), sum(r[2] for r in failed)
            timed_out = elapsed >= self.transfer_timeout * 0.95
            raise TransportError(
                f"mooncake write to peer {link.session} failed: {len(failed)} of {len(batches)} batch(es) "
                f"returned {sorted({r[0] for r in failed})} ({bad_ops} engine ops, {bad_bytes} of {total} bytes, "
                f"from {len(ops)} write ops) after {elapsed:.2f}s"
                + (f" (transfer_timeout {self.transfer_timeout}s)" if timed_out else "")
                + ". The engine does not cancel a failed write: the destination may still be written "
                "after this error, and the source may still be read, so neither may be reused until the "
                "peer is known to be gone or fenced"
            )


def _region(item: Any) -> MemoryRegion:
    if not (isinstance(item, (list, tuple)) and len(item) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
        raise ValueError(f"bad region entry {item!r}")
    return MemoryRegion(int(item[0]), int(item[1]))


class MooncakeLink(Link):
    """A link to one peer engine's announced regions."""

    def __init__(self, local: MooncakeTransport, session: str, announced: RegionSet, segments: PieceIndex) -> None:
        self._local = local
        self.session = session
        self._announced = announced
        self._segments = segments
        self._closed = False

    @property
    def peer(self) -> str:
        return f"mooncake:{self.session}"

    async def write(self, ops: Sequence[WriteOp]) -> None:
        await self._local._write(self, ops)

    async def aclose(self) -> None:
        self._closed = True
        self._local._links.discard(self)
        await anyio.lowlevel.checkpoint()
