"""The ``mooncake`` transport: aioembed's Transport / Link on Mooncake's ``TransferEngine``.

Initialization blocks, so it runs in worker threads (``anyio.to_thread``); so does registration,
except over TCP with the P2P handshake, where it is bookkeeping inside the engine (see
``MooncakeTransport._register_call``).
Writes do not hold a thread while they move: each op is submitted with ``transfer_submit_write``
(in a worker thread of its link: the first submit to a peer blocks while the engine connects) and
the endpoint's one poll loop (:mod:`aioembed_mooncake._transfers`) waits for them. Each link has
its own bound on transfers in flight and on submit threads, so a peer that stops reading stalls
only its own link. The transport works under asyncio and trio alike.

Failure semantics (see the README): the engine cannot cancel a transfer. A write returns (or
raises) once every transfer it submitted has a final status (done or failed: one reported past
``MC_SLICE_TIMEOUT`` is still in flight), after which only bytes already in socket buffers can
still land; or it raises at ``transfer_timeout`` (or at a submit the engine failed with an exception) with
transfers still in flight, and its error's ``settled`` says when they ended.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
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
from aioembed.transports.close_once import CloseOnce
from aioembed.transports.option_names import refuse_unknown_options
from aioembed.transports.tcp_orphans import orphan_horizon, tcp_orphan_seconds_option

from aioembed_mooncake._engine import (
    ENGINE_DEFAULT_TIMEOUT,
    EngineSettings,
    cuda_build_installed,
    destroy_engine,
    load_engine_module,
    rdma_devices,
    start_engine,
)
from aioembed_mooncake._regions import EngineRegistrations, Piece, PieceIndex
from aioembed_mooncake._transfers import (
    DONE,
    PENDING,
    Credits,
    CreditsClosed,
    PendingTransfer,
    TransferPoller,
    queue_key,
)

__all__ = ["DESCRIPTOR_VERSION", "MooncakeLink", "MooncakeTransport", "default_hostname"]

log = logging.getLogger("aioembed_mooncake")

DESCRIPTOR_VERSION = 1

NOT_REGISTERED = -3
"""The engine's answer to unregistering an address it holds no registration at (``ERR_ADDRESS_NOT_REGISTERED``)."""

TCP_QUEUE_PER_PEER = 1024
"""Transfers the engine's TCP transport queues per peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``).

Past this (plus 1024 waiting admissions) it fails transfers at once (``queue-full``), so each link
keeps at most this many transfers in flight.
"""

_SCRATCH_BYTES = 64
_SCRATCH = (ctypes.c_char * _SCRATCH_BYTES)()
"""Where the engine reads peers' bytes into (:meth:`MooncakeTransport.connect`, and the reads that release a
closed link's connections). One buffer for the process, never freed: a read nobody waits for any more (a
cancelled ``connect()``, a release read to a frozen peer at close) may still land in it later. Each endpoint
registers it with its engine; what it holds is never looked at."""
_RELEASE_WAIT = 1.0
"""Seconds a link's close waits for the reads that release the engine's connections to its peer."""
_SETTLE_POLL_MAX = 0.05
"""Seconds between looks at a timed-out write's leftover transfers while no write leads (they may run for
a long time; a sender waiting for them to fence precisely needs no millisecond answer)."""

SUBMIT_THREADS_PER_LINK = 1
"""Worker threads one link may hold for submits. A submit usually takes tens of microseconds, but
the first transfer to a peer opens its data connection and blocks until the peer answers (about
60 s against a frozen one, measured): so submits never run on the event loop, and a frozen peer
holds at most this many threads, not the endpoint's."""

_OPTIONS = (
    "protocol", "device_name", "hostname", "metadata_server", "threads",
    "max_batch_bytes", "max_batch_ops", "transfer_timeout", "tcp_orphan_seconds",
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

    def __init__(self, options: Mapping[str, Any], *, announce: bool = True) -> None:
        """``announce``: log the choices made for unset options (protocol, hostname) and the options ignored. Off
        for a check ahead of an open, which says it all again (``aioembed demo``/``bench`` printed each line twice)."""
        if not isinstance(options, Mapping):
            raise ConfigError(f"mooncake transport_options must be a table/mapping, got {options!r}")
        refuse_unknown_options("mooncake", options, _OPTIONS)

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
            if announce:
                log.info("mooncake transport: protocol 'auto' chose %s (%s)", protocol,
                         f"RDMA devices {present}" if present else "no RDMA device in /sys/class/infiniband")
        elif protocol == "rdma" and not present:
            raise ConfigError(
                "transport_options.protocol='rdma' but this host has no RDMA device "
                "(/sys/class/infiniband is empty or missing); use protocol='tcp' or 'auto'"
            )
        if protocol == "tcp" and devices:
            if announce:
                log.warning("mooncake transport: device_name=%r is ignored with protocol 'tcp'", raw_dev)
            devices = []
        self.protocol = protocol
        self.device_name = ",".join(devices)

        hostname = options.get("hostname")
        if hostname is None:
            hostname = default_hostname()
            if announce:
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
        # 16 MiB: the engine's TCP transport moves one transfer at a time per worker, so a 59 MB field in
        # one transfer ran at 1.5 GB/s and in four at 2.6 GB/s (two processes, 2-core host).
        self.max_batch_bytes = _opt_int(options, "max_batch_bytes", 16 << 20, 64 << 10, 1 << 34)
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

        self.tcp_orphan_seconds = tcp_orphan_seconds_option(options)

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
    endpoint at), ``metadata_server`` (default ``P2PHANDSHAKE``), ``threads`` (worker threads for
    registration where it blocks: RDMA or a metadata server; default 4), ``max_batch_bytes``
    (largest single engine transfer, default 16 MiB), ``max_batch_ops`` (transfers submitted at once per write, default
    ``1024 // threads``), ``transfer_timeout`` (seconds, at least 5; engine default 30: a
    transfer that makes no progress for that long fails) and ``tcp_orphan_seconds`` (over TCP, how long a
    closed socket's bytes may still arrive; default: what this host's kernel retransmits, 102 s with Linux's
    defaults; lower it only where no partition can hold packets that long, e.g. every process on one host).
    """

    name: ClassVar[str] = "mooncake"
    capabilities = TransportCapabilities(
        cuda=cuda_build_installed(), asyncio_only=False, cross_process=True,
        cancel_safe_writes=False,  # a timed-out write is not cancelled: its bytes may land later
        revocable=False,  # no per-peer cut-off: unregistering memory does not stop admitted writes
        # A write that gave up at transfer_timeout leaves transfers moving for as long as they make
        # progress: no time bounds them, so its TransportError says when they ended (``settled``, which
        # the poller learns) and the sender fences until then. write_lifetime covers the other failures
        # (transfers that ended failed, whose bytes may still sit in the peer's socket buffers). A writer
        # process that ended had its connections closed by its kernel: only buffered bytes can land. Over TCP
        # both are at least what a closed socket's kernel goes on retransmitting (the endpoint's properties).
        write_lifetime=32.0,
        orphan_lifetime=2.0,
    )

    def __init__(self, config: _Config, engine: Any, session: str, rpc_port: int, *,
                 engine_timeout: int = 30, lane_timeout: int = 30, tcp_lanes: int = 0) -> None:
        self.config = config
        self.session = session
        self.rpc_port = rpc_port
        self._transfer_timeout = config.transfer_timeout if config.transfer_timeout is not None else engine_timeout
        self._lane_timeout = lane_timeout
        self.closed = False
        self._closing = CloseOnce()
        self._engine: Any = engine
        self._reg = EngineRegistrations()
        self._reg_lock = anyio.Lock()
        self._register_inline = config.protocol == "tcp" and config.metadata_server == "P2PHANDSHAKE"
        """Registration calls on the loop's thread (see :meth:`_register_call`)."""
        self._tcp_sources = config.protocol == "tcp"
        """Writes may read unregistered CPU sources (:meth:`reads_unregistered`)."""
        self._orphan_horizon = orphan_horizon(config.tcp_orphan_seconds) if config.protocol == "tcp" else None
        """Over TCP, how long a closed socket's bytes may still arrive (read once: the lifetimes are asked after
        every write)."""
        self._limiter = anyio.CapacityLimiter(config.threads)
        self._poller = TransferPoller(engine.transfer_check_status)
        self._scratch_address = ctypes.addressof(_SCRATCH)
        self._tcp_lanes = tcp_lanes
        """Connections the engine keeps open per peer (0: none kept), for :meth:`_release_connections`."""
        self._releases: set[PendingTransfer] = set()
        """Reads of :meth:`_release_connections` not seen ending yet (the endpoint's ``aclose()`` does not wait
        for them)."""
        self._lingering: dict[str, tuple[int, list[PendingTransfer]]] = {}
        """Peer session -> (a byte of its pool, its release reads of the last look), for peers whose last link
        closed while they still answered the release reads: the engine keeps its lanes to them (a later link
        reuses them), and they would end in CLOSE-WAIT for good once that peer's process exits (a language-model
        rank that idled out of this encoder and was redeployed later). Each later link close reads from them
        again, unless their last reads have not ended (a frozen peer: nothing piles up), until a read fails: the
        engine then closes those lanes, and the peer is forgotten."""
        self._links: set[MooncakeLink] = set()
        self._calls_lock = threading.Lock()
        self._calls = 0
        """``connect()``'s blocking engine calls under way in worker threads (:meth:`_connect_call`): a cancelled
        ``connect()`` abandons them, and each holds the engine until it returns."""
        self._engine_left: list[Any] | None = None
        """The engine, boxed, where ``aclose()`` found such calls still in it: the last of them destroys it."""
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
    def write_lifetime(self) -> float:
        """How long a failed write may still land once its transfers ended (what the peer's socket buffers
        hold, and the engine's lanes dropping a connection that makes no progress). A write that timed out
        with transfers still moving is not bounded by time: its error's ``settled`` says when they ended.
        Over TCP, a lane that failed closed its socket gracefully: its kernel retransmits what it had queued for
        :func:`~aioembed.transports.tcp_orphans.orphan_retransmit_horizon` (102 s by default), delivered if a
        partition heals meanwhile (32 s, the progress timeout alone, left that window open)."""
        lifetime = float(self.progress_timeout) + 2.0
        if self._orphan_horizon is not None:
            lifetime = max(lifetime, self._orphan_horizon + 2.0)
        return lifetime

    @property
    def orphan_lifetime(self) -> float:
        """How long the writes of a writer whose process ended may still land: over RDMA, what was in flight
        (the kernel destroys the process's queue pairs); over TCP, what its kernel goes on retransmitting for
        the closed sockets (see :attr:`write_lifetime`), which a partition healing after the process died
        delivers."""
        if self._orphan_horizon is not None:
            return self._orphan_horizon + 2.0
        return self.capabilities.orphan_lifetime

    @property
    def progress_timeout(self) -> int:
        """Seconds without progress after which the engine's TCP lane drops a connection. The engine
        reads ``MC_TCP_PROGRESS_TIMEOUT_SEC`` for every transfer (default 30; the plugin sets it for the
        process from the first ``transfer_timeout`` and never changes it while engines run, see ``_engine``),
        so it is taken when the endpoint opens; as a bound on when a failed write's bytes may still land,
        never taken below 30."""
        return max(ENGINE_DEFAULT_TIMEOUT, self._lane_timeout)

    @property
    def transfer_timeout(self) -> int:
        """Seconds after which the engine gives up on a write: ``transfer_timeout``, else what the engine
        took from ``MC_TRANSFER_TIMEOUT`` when it was constructed (default 30)."""
        return self._transfer_timeout

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """The validation :meth:`open` runs (``_Config``): no engine is started. It reads this host's RDMA devices
        from sysfs and, without ``hostname``, finds the address to advertise (a UDP socket's route, no packet)."""
        _Config(options, announce=False)

    @classmethod
    async def open(cls, options: Mapping[str, Any]) -> Self:
        # Validating the options resolves host names and reads sysfs: blocking, so off the loop.
        config = await anyio.to_thread.run_sync(_Config, options)
        started = await anyio.to_thread.run_sync(start_engine, config.engine_settings())
        log.info("mooncake transport: engine up, session %s, protocol %s%s", started.session, config.protocol,
                 f", devices {config.device_name}" if config.device_name else "")
        self = cls(config, started.engine, started.session, started.rpc_port,
                   engine_timeout=started.transfer_timeout, lane_timeout=started.lane_timeout,
                   tcp_lanes=started.tcp_lanes)
        # The endpoint holds the engine now, and aclose() destroys it only where no other reference is left: not
        # `started`, nor a bound method of the engine in the frames of a cancellation's traceback.
        del started

        def register_scratch() -> int:
            return int(self._engine.register_memory(self._scratch_address, _SCRATCH_BYTES))

        try:
            rc = await anyio.to_thread.run_sync(register_scratch)
            if rc != 0:
                raise TransportError(f"mooncake transport: registering a {_SCRATCH_BYTES}-byte scratch buffer "
                                     f"returned {rc}")
        except BaseException:
            # Cancelled (a start under a deadline) or failed with the engine up: destroyed here, as aclose() does
            # it. Left to the garbage collector, its destructor stalled the interpreter (about 1 s) wherever the
            # last reference went, and the environment set for it was never the user's again.
            await self.aclose()
            raise
        return self

    def _check_open(self) -> Any:
        if self.closed or self._engine is None:
            raise TransportError(f"mooncake endpoint {self.session} is closed")
        return self._engine

    async def aclose(self) -> None:
        await self._closing.run(self._close)

    async def _close(self) -> None:
        self.closed = True
        for link in list(self._links):
            link._closed = True
            link._credits.close()  # writes waiting for credits fail now, not once they got them
        self._links.clear()
        # Writes already handed to the engine cannot be cancelled: let them end (the engine's
        # progress timeout bounds them) before unregistering their memory.
        await self._idle.wait()
        # Not the reads that release closed links' connections: one to a frozen peer ends only at the engine's
        # progress timeout, and what it reads goes to the process's scratch buffer, never freed.
        await self._poller.drain(skip=self._releases)
        self._poller.forget(self._releases)
        self._releases.clear()
        self._lingering.clear()
        self._poller.close()
        async with self._reg_lock:
            pieces = self._reg.clear()
            engine = self._engine
            self._engine = None
            if pieces:
                rc = await self._register_call(engine.batch_unregister_memory, [p.start for p in pieces])
                if rc != 0:
                    log.warning("mooncake transport: unregistering %d spans at close returned %d", len(pieces), rc)
            self._reg.forget(pieces)
        await anyio.to_thread.run_sync(engine.unregister_memory, self._scratch_address)
        box = [engine]
        del engine
        with self._calls_lock:
            calls = self._calls
            if calls:
                self._engine_left = box
        if calls:
            # Not waited for: against a frozen peer such a call returns only at the engine's timeout (about 60 s),
            # and it moves nothing into registered memory (its read lands in the process's scratch buffer).
            log.info("mooncake transport: endpoint %s closed with %d connect() call(s) still in its engine (a "
                     "cancelled connect() to an unanswering peer): the engine is destroyed when they return",
                     self.session, calls)
            return
        await anyio.to_thread.run_sync(destroy_engine, box, self.rpc_port)

    async def _connect_call(self, name: str, *args: Any) -> int:
        """Run the engine's blocking ``name(*args)`` for ``connect()`` in a worker thread that a cancellation
        abandons (against a frozen peer it returns only at the engine's timeout, about 60 s).

        Such a call holds the engine while it runs, and ``aclose()`` does not wait for it: it leaves the engine to
        the last of these calls to return, which destroys it as ``aclose()`` would have, and gives the environment
        back (see ``_engine``). Before, the engine went wherever its last reference went once the call returned (a
        worker thread, the loop if ``connect()`` still ran) and the environment set for it was never the user's
        again. So nothing here keeps a reference to the engine past the call: not this coroutine, not a call the
        worker never started (cancelled before it began)."""
        held = [getattr(self._check_open(), name)]
        with self._calls_lock:
            self._calls += 1

        def run() -> int:
            with self._calls_lock:
                if not held:
                    return 0  # given up before it began (the caller is gone)
                call = held.pop()
            try:
                return int(call(*args))
            finally:
                del call
                box = self._call_ended()
                if box is not None:
                    destroy_engine(box, self.rpc_port)

        try:
            return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
        except BaseException:
            with self._calls_lock:
                never_ran = bool(held)
                held.clear()
            if never_ran and (box := self._call_ended()) is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(destroy_engine, box, self.rpc_port)
            raise

    def _call_ended(self) -> list[Any] | None:
        """One of :meth:`_connect_call`'s calls is out of the engine; the engine's box if it was the last one and
        the endpoint closed meanwhile (the caller destroys it then)."""
        with self._calls_lock:
            self._calls -= 1
            if self._calls or self._engine_left is None:
                return None
            box, self._engine_left = self._engine_left, None
            return box

    # -- registration --------------------------------------------------------------------

    def reads_unregistered(self, device: str) -> bool:
        """Over TCP the engine reads a write's source as plain process memory (its TCP client writes the bytes
        from the source address; only the receiving side checks that the destination lies in a registered
        buffer), so the sender writes from unregistered CPU tensors: no staging copy, no registration per
        ``send()``. Checked against mooncake-transfer-engine 0.3.13.post1 (the conformance suite's
        ``test_write_from_unregistered_source``, and a raw engine probe: see the README). Over
        RDMA a source must be registered (pinned, with a key)."""
        return self._tcp_sources and device == "cpu"

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        # The engine is looked up where it is called, never held in a local: a raised error's traceback keeps
        # this frame, and an engine it held would outlive aclose() (see _write).
        self._check_open()
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
                    # A failed batch leaves nothing registered, so nothing is recorded: the engine checks the whole
                    # batch (zero length, overlaps within it and with its registrations) before it registers any
                    # span, and unregisters them all if its transport fails one (0.3.13.post1; pinned by
                    # test_a_failed_registration_batch_leaves_nothing_registered).
                    rc = await self._register_call(
                        self._engine.batch_register_memory, [p.start for p in new], [p.length for p in new]
                    )
                    if rc != 0:
                        raise TransportError(
                            f"mooncake transport: registering {len(new)} span(s), {sum(p.length for p in new)} bytes "
                            f"(for {len(regions)} region(s)) failed: batch_register_memory returned {rc}"
                        )
                self._reg.commit_add(regions, new)

    async def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        self._check_open()  # the engine is not held in a local: see register()
        regions = list(regions)
        if not regions:
            return
        with anyio.CancelScope(shield=True):
            async with self._reg_lock:
                self._check_open()
                orphans = self._reg.remove(regions)  # raises, changing nothing, for unknown regions
                if orphans:
                    before = set(self._reg.refused(orphans))
                    refused = await self._unregister_pieces(orphans)
                    # Kept recorded: they are retried on the next unregister and at close. Spans an earlier call
                    # reported already are only logged: this call's own spans are unregistered.
                    if not refused:
                        return
                    spans = ", ".join(f"{p.length} bytes at {p.start:#x} ({rc})" for p, rc in refused)
                    if all(p in before for p, _ in refused):
                        log.warning("mooncake transport: the engine still refuses to unregister %s", spans)
                    else:
                        raise TransportError(f"mooncake transport: unregistering {len(orphans)} span(s) failed: the "
                                             f"engine refused {len(refused)}, kept for a retry: {spans}")

    async def _unregister_pieces(self, pieces: Sequence[Piece]) -> list[tuple[Piece, int]]:
        """Unregister engine pieces that no region overlaps any more; forget those the engine no longer holds and
        return the others, with the engine's answer for each.

        The engine's ``batch_unregister_memory`` is not all-or-nothing (0.3.13.post1): it goes on past a span it
        fails to unregister, so a failed batch may have unregistered the others, and an address it unregistered
        answers ``NOT_REGISTERED`` from then on. Retried as it was, the batch failed for good, and so did every
        later unregistration, whose batch included the retried spans. So after a failed batch each span is asked
        on its own, a span the engine does not hold counts as unregistered, and only spans refused for another
        reason stay recorded. Those are retried one at a time, never in a batch with others: the engine forgets none of
        a failed batch's addresses in its own table (a registration over them is refused as overlapping), so a
        retried span that fails again would hold the rest of its batch there too."""
        retried = self._reg.refused(pieces)
        fresh = [p for p in pieces if p not in retried]
        if fresh:
            rc = await self._register_call(self._engine.batch_unregister_memory, [p.start for p in fresh])
            if rc == 0:
                self._reg.forget(fresh)
            else:
                log.warning("mooncake transport: unregistering %d span(s) returned %d: asking the engine for each "
                            "span on its own", len(fresh), rc)
                retried += fresh
        refused: list[tuple[Piece, int]] = []
        for p in retried:
            rc = await self._register_call(self._engine.batch_unregister_memory, [p.start])
            if rc in (0, NOT_REGISTERED):
                self._reg.forget([p])
            else:
                refused.append((p, rc))
        self._reg.refuse(p for p, _ in refused)
        return refused

    async def _register_call(self, call: Callable[..., int], *args: Any) -> int:
        """Run an engine (un)registration call: on this thread over TCP with the P2P handshake, where it
        only updates the engine's own segment table (no pinning, no metadata server): 40-60 us for the
        three spans of a 59 MB request on the 2-core development host, while the worker-thread hop
        around it took 0.2-0.9 ms, and up to 3 ms for the loop to see the result, on the path of every
        ``send()`` that registers. RDMA pins the pages and a metadata server is a network round trip:
        those calls stay in a worker thread."""
        if self._register_inline:
            return int(call(*args))
        return int(await anyio.to_thread.run_sync(call, *args, limiter=self._limiter))

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
        # No reference to the engine is kept across the awaits below (see _connect_call).
        probes = hasattr(self._check_open(), "send_probe")
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
        if probes:
            rc = await self._connect_call("send_probe", session)
            if rc != 0:
                raise TransportError(
                    f"mooncake peer {session} is not reachable (probe returned {rc}); the peer advertises the "
                    "address in its transport_options.hostname, which must be reachable from this host"
                )
        # Open the data connection now, while the peer answers: the engine sets connections up under
        # a lock every submit needs, so a first transfer to a peer that has frozen meanwhile would
        # stall writes to every peer for about a minute. A one-byte read leaves the peer untouched.
        first = min(announced, key=lambda r: r.address, default=None)
        if first is not None:
            rc = await self._connect_call("transfer_sync_read", session, self._scratch_address, first.address, 1)
            if rc != 0:
                raise TransportError(f"mooncake peer {session}: opening the data connection (a one-byte read of "
                                     f"its pool) returned {rc}")
        self._check_open()
        link = MooncakeLink(self, session, announced, segments, None if first is None else first.address)
        self._links.add(link)
        self._lingering.pop(session, None)  # its lanes are a link's again: its close releases them
        return link

    def _engine_busy(self) -> None:
        """A write (or release) uses the engine: ``aclose()`` waits for ``_idle`` before destroying it."""
        self._inflight += 1
        if self._inflight == 1:
            self._idle = anyio.Event()

    def _engine_done(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def _release_connections(self, link: MooncakeLink) -> None:
        """Let the engine close its connections to the peer of a link that just closed, if no other link of this
        endpoint goes to that peer, and to the peers that still answered when their links closed earlier.

        The engine's TCP transport keeps up to ``MC_TCP_LANES_PER_PEER`` (default 4) connections ("lanes") open
        to every peer, and nothing closes an idle one: a peer that died while they were idle leaves them in
        CLOSE-WAIT for good (its next process has another port, so they are never used again), four file
        descriptors per dead peer. A transfer that fails on a lane closes that lane (only that one), and the
        binding has no call to close a peer's connections. So this queues one one-byte *read* of the peer's
        pool per lane, into the process's scratch buffer: nothing is written to the peer, whatever became of
        it. Queued together, they take every idle lane at once. On a dead peer's stale lane a read fails within
        milliseconds and the engine closes it; one more than there are lanes fails at its reconnect (refused).
        On a live peer they succeed and the lanes stay (a later link reuses them): the peer is kept in
        :attr:`_lingering`, and read from again at each later link close, until its reads fail. On a frozen one
        they fail at the engine's progress timeout, closing those lanes too (kept meanwhile: it may thaw; no new
        reads go to it while its last ones have not ended). The link's close waits for its own peer's reads at
        most ``_RELEASE_WAIT`` (seen ending, they give back their engine ids), not for the lingering peers'; the
        endpoint's ``aclose()`` leaves what is left to the engine."""
        n = self._tcp_lanes
        if n <= 0 or self.closed:
            return
        linked = {other.session for other in self._links}
        targets: dict[str, int] = {}
        for session, (address, last) in list(self._lingering.items()):
            if session in linked or _any_failed(last):
                del self._lingering[session]  # a link's again, or a read failed: the engine closed its lanes
            elif all(t.status == DONE for t in last):  # it answered the last look: look again
                targets[session] = address
        if link._probe_address is not None and link.session not in linked:
            targets[link.session] = link._probe_address
        own = link.session in targets  # never a lingering one: a session is lingering only while unlinked
        if not targets:
            return
        engine = self._check_open()
        read = engine.batch_transfer_async_read
        out: dict[str, list[PendingTransfer]] = {}

        def run() -> None:
            for session, address in targets.items():
                reads = out.setdefault(session, [])
                for _ in range(n):
                    batch = int(read(session, [self._scratch_address], [address], [1]))
                    if batch == 0:  # refused at submit: the engine has no connection state to release for it
                        break
                    reads.append(PendingTransfer(batch, 1))

        self._engine_busy()  # aclose() destroys the engine only once this submit returned
        try:
            with anyio.CancelScope(shield=True):  # submitted reads must be tracked, whatever happens
                await anyio.to_thread.run_sync(run, limiter=link._submits)
        finally:
            self._engine_done()
            submitted = [t for reads in out.values() for t in reads]
            for t in submitted:
                t.on_done = functools.partial(self._releases.discard, t)
            self._releases.update(submitted)
            self._poller.add(submitted)
            for session, address in targets.items():
                reads = out.get(session, [])
                if reads and not any(o.session == session for o in self._links):
                    self._lingering[session] = (address, reads)  # looked at again at the next link close
                else:
                    self._lingering.pop(session, None)  # refused at submit, or linked meanwhile
        log.debug("mooncake transport: link to %s closed; one-byte reads release the engine's connections to %s",
                  link.session, {session: len(reads) for session, reads in out.items()})
        if not own:
            return
        # Seen ending, they give back their engine ids and the lanes are closed now: nothing else may poll this
        # endpoint for a long time (no write goes on). A dead peer fails them in milliseconds, a live one
        # answers them; a frozen one only at the engine's progress timeout, which nobody waits for. Only this
        # link's own reads are waited for: a lingering peer that froze would hold every later close.
        mine = out.get(link.session, [])
        with anyio.move_on_after(_RELEASE_WAIT):
            await self._poller.watch(lambda: all(t.status != PENDING for t in mine), max_delay=_SETTLE_POLL_MAX)
        if _any_failed(mine):
            self._lingering.pop(link.session, None)  # dead: the engine closed its lanes

    # -- writes (called by links) --------------------------------------------------------

    def _pieces(self, ops: Sequence[WriteOp], link: MooncakeLink) -> list[tuple[int, int, int]]:
        """Validate ops and cut them into engine transfers of (src, dst, length): at the edges of
        engine registrations on both sides, and every ``max_batch_bytes``."""
        regions = self._reg.regions
        local = self._reg.index()
        step = self.config.max_batch_bytes
        for op in ops:
            if op.length <= 0:
                raise TransportError(f"write op with non-positive length: {op}")
            if not self._tcp_sources:  # over TCP any CPU source will do (reads_unregistered)
                regions.check(op.src, op.length, "write source")
            link._announced.check(op.dst, op.length, f"write destination at {link.peer}")
        pieces: list[tuple[int, int, int]] = []
        for op in ops:
            src_cuts = local.cut_points(op.src, op.length)
            dst_cuts = link._segments.cut_points(op.dst, op.length)
            if not src_cuts and not dst_cuts and op.length <= step:  # the usual op: one engine transfer
                pieces.append((op.src, op.dst, op.length))
                continue
            cuts = set(src_cuts)
            cuts.update(dst_cuts)
            cuts.update(range(step, op.length, step))
            bounds = [0, *sorted(cuts), op.length]
            for a, b in itertools.pairwise(bounds):
                pieces.append((op.src + a, op.dst + a, b - a))
        return pieces

    async def _write(self, link: MooncakeLink, ops: Sequence[WriteOp]) -> None:
        if link._closed or self.closed:
            raise TransportError(f"write on a closed link to {link.peer}")
        # Not `engine = self._check_open()`: the error a failed write raises keeps this frame in its traceback, and
        # an engine held here outlived the endpoint's aclose() for as long as a sender kept the error (a room's
        # failure), destroyed later wherever that went, the environment set for it never given back. The engine
        # is looked up where it is called (aclose() keeps it while a write runs: _engine_busy).
        self._check_open()
        if not ops:
            await anyio.lowlevel.checkpoint()
            return
        pieces = self._pieces(ops, link)
        total = sum(op.length for op in ops)
        started = time.monotonic()
        failed: list[PendingTransfer] = []
        stuck: list[PendingTransfer] = []
        refused = 0
        done = True
        self._engine_busy()
        try:
            per = min(link._credits.total, self.config.max_batch_ops)
            deadline: float | None = None
            for i in range(0, len(pieces), per):
                chunk = pieces[i:i + per]
                taken = await self._take_credits(link, len(chunk))
                if deadline is None:  # from the first submit: a wait for credits is not the transfer's time
                    deadline = anyio.current_time() + self.transfer_timeout
                transfers: list[PendingTransfer] = []
                try:
                    await self._submit(link, chunk, transfers)
                    done = await self._poller.wait(transfers, deadline)  # not cancellable: see wait()
                finally:
                    self._return_credits(link, transfers, taken)
                refused += len(chunk) - len(transfers)
                failed += [t for t in transfers if t.status != DONE]
                if transfers and all(t.status == DONE for t in transfers):
                    link._warm = True
                if not done:
                    stuck = [t for t in transfers if t.status == PENDING]
                    break
                if failed or refused:
                    break
        finally:
            self._engine_done()
        if stuck:
            raise TransportError(
                f"mooncake write to peer {link.session} did not complete within transfer_timeout="
                f"{self.transfer_timeout}s: {len(stuck)} engine transfers ({sum(t.length for t in stuck)} of {total} "
                f"bytes) still pending{_slow_note(stuck)}. The engine cannot cancel them: they may still land for as "
                "long as they make progress, so the destination is not reused before they ended", may_land=True,
                settled=functools.partial(self._settled, stuck))
        if failed or refused:
            self._raise_failed(link, failed, refused=refused, total=total, pieces=len(pieces), ops=len(ops),
                               elapsed=time.monotonic() - started)

    async def _take_credits(self, link: MooncakeLink, n: int) -> int:
        """The link's credits for ``n`` transfers. While this waits, it sees that the endpoint is polled when
        no write leads: the credits it waits for may be held by transfers a timed-out write left behind,
        which nothing else would poll while every writer waits here (credits held by writes in flight come
        back as their writers see them end)."""
        credits = link._credits
        # The one cancellation point between a write's batches (its waits are shielded, a warm submit does not
        # yield): a room's deadline or a cancelled send() stops a many-batch write here. No yield otherwise.
        await anyio.lowlevel.checkpoint_if_cancelled()
        taken = credits.take_now(n)
        if taken is not None:
            return taken
        granted: list[int] = []
        closed = False
        try:
            async with anyio.create_task_group() as tg:
                async def take() -> None:
                    nonlocal closed
                    try:
                        granted.append(await credits.take(n))
                    except CreditsClosed:  # noted here: out of the task group, it would come wrapped
                        closed = True
                    tg.cancel_scope.cancel()

                tg.start_soon(take)
                await self._poller.watch(lambda: False, max_delay=_SETTLE_POLL_MAX)  # cancelled by take()
        except BaseException:
            if granted:  # cancelled from outside just as the credits came
                credits.give(granted[0])
            raise
        if closed:
            raise TransportError(f"write on a closed link to {link.peer}", may_land=False)
        return granted[0]

    async def _settled(self, stuck: list[PendingTransfer]) -> None:
        """Until every transfer a timed-out write left in the engine has a final status (for the sender's
        fencing: see ``TransportError.settled``); sees that they are polled while no write leads. Any leftover
        that did not complete is given ``write_lifetime`` more. One the engine reports failed (-1) has ended in
        every lane, its connection closed first, but that close is graceful: what the sender's kernel still
        had queued for the socket (MiBs) is delivered, or retransmitted after a partition heals, whenever the
        peer reads again, and so is what sits in the peer's buffers. ``orphan_lifetime`` (of a process gone)
        does not bound that; the ledger's floor (``write_lifetime`` from the write's failure) covers a
        leftover that ends near the write's deadline, but not one that kept moving long after it."""
        await self._poller.watch(lambda: all(t.status != PENDING for t in stuck), max_delay=_SETTLE_POLL_MAX)
        if any(t.status != DONE for t in stuck):
            await anyio.sleep(self.write_lifetime)

    @staticmethod
    def _return_credits(link: MooncakeLink, transfers: list[PendingTransfer], taken: int) -> None:
        """Give back the link's credits of ``transfers``: now for the ended ones (and those never
        submitted), when they end for the rest (a write that gave up leaves them in the engine)."""
        pending = [t for t in transfers if t.status == PENDING]
        for t in pending:
            t.on_done = lambda: link._credits.give(1)
        link._credits.give(taken - len(pending))

    async def _submit(self, link: MooncakeLink, chunk: list[tuple[int, int, int]], out: list[PendingTransfer]) -> None:
        """Queue every transfer of ``chunk`` into ``out`` (stopping at the first the engine refuses: id 0).
        What was submitted is tracked even if a submit raises midway (the rest may still be moving), and the
        ``TransportError`` raised then says, as a timed-out write's does (``settled``), when those ended: they go
        on moving for as long as they make progress, which ``write_lifetime`` alone does not bound."""
        def run() -> None:
            for src, dst, n in chunk:  # the engine looked up per call, held by no frame (see _write)
                batch = int(self._engine.transfer_submit_write(link.session, src, dst, n))
                if batch == 0:
                    break
                out.append(PendingTransfer(batch, n, queue_key(link.session, n)))

        try:
            if link._warm:
                # The engine has a connection to this peer: a submit only queues (microseconds), so no
                # thread hop, and no checkpoint either: the caller's wait for the transfers yields next.
                run()
            else:
                # A link's first submits go through a thread: opening a connection to a slow or frozen
                # peer can block inside the engine.
                with anyio.CancelScope(shield=True):  # submitted transfers must be tracked, whatever happens
                    await anyio.to_thread.run_sync(run, limiter=link._submits)
        except Exception as exc:
            left = list(out)
            raise TransportError(
                f"mooncake write to peer {link.session}: submitting engine transfer {len(out) + 1} of {len(chunk)} "
                f"raised {type(exc).__name__}: {exc}"
                + (f"; the {len(left)} submitted before it ({sum(t.length for t in left)} bytes) cannot be cancelled "
                   "and may still land for as long as they make progress, so the destination is not reused before "
                   "they ended" if left else ""),
                may_land=True, settled=functools.partial(self._settled, left) if left else None,
            ) from exc
        finally:
            self._poller.add(out)

    def _raise_failed(self, link: MooncakeLink, failed: list[PendingTransfer], *, refused: int, total: int,
                      pieces: int, ops: int, elapsed: float) -> None:
        statuses = sorted({t.status for t in failed})
        # The lanes drop a peer that made no progress for their timeout (from transfer_timeout where the plugin set
        # it): a hung peer's write then ends failed at about the time the caller's deadline would have fired.
        timed_out = self.config.protocol == "tcp" and elapsed >= self._lane_timeout * 0.95
        what = []
        if failed:
            what.append(f"{len(failed)} of {pieces} engine transfers ended with status {statuses} "
                        f"({sum(t.length for t in failed)} bytes)")
        if refused:
            what.append(f"{refused} transfers refused at submit (peer unknown or unreachable)")
        raise TransportError(
            f"mooncake write to peer {link.session} failed: {'; '.join(what)}, of {total} bytes from {ops} write "
            f"ops, after {elapsed:.2f}s"
            + (f" (no progress within the engine's TCP lane timeout, {self._lane_timeout}s: the peer is hung or "
               "unreachable)" if timed_out else "")
            + ". The engine cannot cancel a transfer: bytes of this write already in a socket's buffers (this host's "
            "queue or the peer's) may still be written there, so the destination may not be reused until that is "
            "ruled out"
        )


def _region(item: Any) -> MemoryRegion:
    if not (isinstance(item, (list, tuple)) and len(item) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
        raise ValueError(f"bad region entry {item!r}")
    return MemoryRegion(int(item[0]), int(item[1]))


def _slow_note(stuck: Sequence[PendingTransfer]) -> str:
    """Why a write timed out, where the engine said so: it reports a transfer with a slice past its slice timeout
    (RDMA), which stays in flight."""
    slow = sum(t.slow for t in stuck)
    return f" ({slow} of them reported past MC_SLICE_TIMEOUT by the engine)" if slow else ""


def _any_failed(reads: Sequence[PendingTransfer]) -> bool:
    """A release read ended in failure: the engine closed the lane it ran on."""
    return any(t.status not in (DONE, PENDING) for t in reads)


class MooncakeLink(Link):
    """A link to one peer engine's announced regions."""

    def __init__(self, local: MooncakeTransport, session: str, announced: RegionSet, segments: PieceIndex,
                 probe_address: int | None = None) -> None:
        self._local = local
        self.session = session
        self._probe_address = probe_address
        """A byte of the peer's announced pool that reads may take (what ``connect()`` read), or None."""
        self._announced = announced
        self._segments = segments
        self._closed = False
        self._credits = Credits(TCP_QUEUE_PER_PEER)  # this peer's share only: a stalled peer stalls itself
        self._submits = anyio.CapacityLimiter(SUBMIT_THREADS_PER_LINK)
        self._warm = False
        """A transfer to this peer completed: the engine holds a connection, submits only queue."""

    @property
    def peer(self) -> str:
        return f"mooncake:{self.session}"

    async def write(self, ops: Sequence[WriteOp]) -> None:
        await self._local._write(self, ops)

    async def aclose(self) -> None:
        if self._closed:
            await anyio.lowlevel.checkpoint()
            return
        self._closed = True
        self._credits.close()
        self._local._links.discard(self)
        await self._local._release_connections(self)
