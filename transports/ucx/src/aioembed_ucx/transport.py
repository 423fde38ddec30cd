"""The UCX transport: ``Link.write`` as two-sided UCX tag messages, through ucxx.

ucxx exposes no one-sided put/get to Python, so the side that owns the memory takes part in
every write. It runs a UCX listener (started by the first ``descriptor()``: an endpoint that
never announces memory never opens a port); each accepted connection is served by a task
that this transport owns and cancels on ``aclose``. For each write it receives a header,
checks every destination span against the memory registered *now*, posts one receive per op
straight into that memory (no staging copy), tells the writer to go, and acknowledges once
every byte has landed. ``Link.write`` returns only after that acknowledgement, so the data is
visible before the control plane announces it. See :mod:`aioembed_ucx._wire` for the messages.

Writes on one link run concurrently: each has its own id, and every message of a write
carries that id in its tag, so neither side serialises them.

Failure: an endpoint error (peer gone) fails pending operations within milliseconds on a
live host; a frozen peer is caught by ``write_timeout``. Either way the UCX endpoint is
aborted (the owning side's pending receives into the pool are cancelled with it) and the
write raises :class:`~aioembed.errors.TransportError`; the next write reconnects. A write
whose caller is cancelled once it posted runs to its end first (see :meth:`UcxLink._write`):
the endpoint is shared by every write on the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import anyio.to_thread
import msgpack
import sniffio
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
from aioembed.transports.tcp_orphans import orphan_horizon, ucx_tls_may_use_tcp

from aioembed_ucx import _wire as w
from aioembed_ucx._body_budget import BodyBudget
from aioembed_ucx._context import context_settings, ensure_context, load_ucxx
from aioembed_ucx._graveyard import GRAVEYARD as _GRAVEYARD
from aioembed_ucx._listener import Listener
from aioembed_ucx._options import MAX_EAGER_BYTES, UcxOptions, tls_may_use_rdma
from aioembed_ucx._progress import (
    Posted,
    bury_posted,
    cancel_posted,
    close_at_once,
    close_posted,
    kick,
    post,
    settle_graveyard,
    tag_recv,
    tag_send,
    wait_posted,
    wait_request,
)

__all__ = ["UcxLink", "UcxTransport"]

log = logging.getLogger("aioembed.transports.ucx")

_DESCRIPTOR_VERSION = 1
BODY_BUDGET = w.MAX_BODY
"""Write-header bytes one connection's writes in progress may hold together (see :mod:`aioembed_ucx._body_budget`)."""
TRANSPORT_BODY_BUDGET = 4 * BODY_BUDGET
"""Write-header bytes the writes in progress of all connections to one endpoint may hold together: room for four
peers' largest headers at once (a usual header is tens of bytes), and a bound that does not grow with the number
of peers. A connection past it waits as past its own budget (reading nothing more from that peer)."""


# -- memory ------------------------------------------------------------------------------


class _CudaSpan:
    """A byte span of device memory, described by ``__cuda_array_interface__`` (zero-copy)."""

    def __init__(self, address: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "data": (address, False), "shape": (length,), "typestr": "|u1", "strides": None, "version": 3,
        }


def _buffer(address: int, length: int, device: str) -> object:
    """A zero-copy, writable buffer over ``[address, address + length)`` that ucxx accepts."""
    if device == "cpu":
        return (ctypes.c_char * length).from_address(address)
    return _CudaSpan(address, length)


class _Memory:
    """Registered (or announced) regions: all together and per device."""

    def __init__(self, regions: Iterable[MemoryRegion] = ()) -> None:
        self.all = RegionSet()
        self.by_device: dict[str, RegionSet] = {}
        self.nbytes = 0
        """The registered regions' lengths summed (repeats and overlaps too): at least the bytes they cover."""
        self.add(list(regions))

    def add(self, regions: Sequence[MemoryRegion]) -> None:
        self.all.add(regions)
        for r in regions:
            self.by_device.setdefault(r.device, RegionSet()).add([r])
            self.nbytes += r.length

    def remove(self, regions: Sequence[MemoryRegion]) -> None:
        self.all.remove(regions)  # raises, removing nothing, if one is not registered
        for r in regions:
            self.nbytes -= r.length
            rs = self.by_device[r.device]
            rs.remove([r])
            if not len(rs):
                del self.by_device[r.device]

    def device_of(self, address: int, length: int) -> str | None:
        """The device whose registered memory covers the whole span, or None."""
        for device, rs in self.by_device.items():
            if rs.covers(address, length):
                return device
        return None


def _check_device(region: MemoryRegion) -> None:
    d = region.device
    if d == "cpu" or (d.startswith("cuda:") and d[5:].isdigit()):
        return
    raise TransportError(f"ucx transport registers 'cpu' or 'cuda:N' memory, got device {d!r} in {region}")


def _coalesce(ops: Sequence[tuple[int, int, int, str, str]]) -> list[tuple[int, int, int, str, str]]:
    """Merge ops that continue the previous one on both sides (same devices)."""
    out: list[tuple[int, int, int, str, str]] = []
    for src, dst, n, sdev, ddev in ops:
        if out:
            ps, pd, pn, psd, pdd = out[-1]
            if ps + pn == src and pd + pn == dst and psd == sdev and pdd == ddev:
                out[-1] = (ps, pd, pn + n, sdev, ddev)
                continue
        out.append((src, dst, n, sdev, ddev))
    return out


# -- descriptor --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Peer:
    endpoint: str
    host: str
    port: int
    memory: _Memory
    eager_bytes: int = 0
    """The largest write the peer takes without a go-ahead (0 in descriptors of plugins without it)."""

    @property
    def name(self) -> str:
        return f"ucx://{self.host}:{self.port}/{self.endpoint[:8]}"


def _parse_descriptor(blob: bytes) -> _Peer:
    try:
        d = msgpack.unpackb(blob, raw=False)
        if not isinstance(d, dict) or d.get("transport") != UcxTransport.name:
            raise ValueError("not a ucx descriptor")
        if d.get("v") != _DESCRIPTOR_VERSION:
            raise ValueError(f"descriptor version {d.get('v')!r}, this plugin speaks {_DESCRIPTOR_VERSION}")
        endpoint, host, port = d["endpoint"], d["host"], d["port"]
        if not (isinstance(endpoint, str) and isinstance(host, str) and host and isinstance(port, int)
                and 0 < port < 65536):
            raise ValueError("bad endpoint, host or port")
        regions = []
        for a, n, dev in d["regions"]:
            if not (isinstance(a, int) and isinstance(n, int) and isinstance(dev, str)):
                raise ValueError("bad region")
            r = MemoryRegion(a, n, dev)
            _check_device(r)
            regions.append(r)
        eager = d.get("eager", 0)
        if not (isinstance(eager, int) and not isinstance(eager, bool) and eager >= 0):
            raise ValueError(f"bad eager size {eager!r}")
        # A later plugin may take more; this one never sends more than its own cap.
        return _Peer(endpoint, host, port, _Memory(regions), min(eager, MAX_EAGER_BYTES))
    except Exception as exc:
        raise TransportError(f"bad ucx descriptor ({len(blob)} bytes): {exc}") from exc


# -- transport ---------------------------------------------------------------------------


class UcxTransport(Transport):
    """Endpoint of the UCX transport (asyncio only). Options: see :class:`UcxOptions`."""

    name: ClassVar[str] = "ucx"
    # Not cancel-safe: after a write failed and the writer aborted its endpoint, bytes it had
    # already sent can still be delivered into the owner's posted receives until the owner
    # processes the disconnect (milliseconds on a running owner, at thaw for a frozen one).
    # Both lifetimes are 2 s where UCX cannot use TCP; over TCP much longer, per endpoint (see the properties).
    capabilities = TransportCapabilities(
        cuda=True, asyncio_only=True, cross_process=True, cancel_safe_writes=False, revocable=False,
        write_lifetime=2.0, orphan_lifetime=2.0,
    )

    def __init__(self, options: UcxOptions, ucxx: Any, host: str) -> None:
        self.id = uuid.uuid4().hex
        self.options = options
        self.host = host
        self.closed = False
        self._closing = CloseOnce()
        self._memory = _Memory()
        tls, mode = context_settings(ucxx)
        self._unregistered_cpu = not tls_may_use_rdma(tls, _rdma_devices()) and not mode.startswith("thread")
        """Writes read unregistered CPU sources (:meth:`reads_unregistered`); fixed for the endpoint's life."""
        self._orphan_horizon: float | None = None
        """Over TCP, how long a closed socket's bytes may still land here (None: no TCP): :attr:`orphan_lifetime`."""
        if ucx_tls_may_use_tcp(tls):
            self._orphan_horizon = orphan_horizon(options.tcp_orphan_seconds)
        self._ucxx = ucxx
        self._errors: tuple[type[BaseException], ...] = (ucxx.exceptions.UCXError,)
        self._listener: Listener | None = None
        self._loop = asyncio.get_running_loop()
        self._serving: set[asyncio.Task[None]] = set()
        self._server_eps: set[Any] = set()
        self._links: set[UcxLink] = set()
        self.writes_received = 0
        """Writes this endpoint took into its memory as the owning side (refused ones not counted)."""
        self.eager_writes_received = 0
        """Of those, the ones that came without a go-ahead (kind ``EAGER``)."""
        self.body_bytes_held = 0
        """Write-header bytes announced to this endpoint, as the owning side, by writes still in progress (each
        connection's at most :data:`BODY_BUDGET`, all together at most :data:`TRANSPORT_BODY_BUDGET`)."""
        self._body_budget = BodyBudget(TRANSPORT_BODY_BUDGET, self._count_body_bytes)
        self._connections_refused_before = 0
        """Refused by a listener closed since (``connections_refused`` outlives it)."""

    @property
    def regions(self) -> RegionSet:
        """Every registered region (with repeats), for inspection."""
        return self._memory.all

    @property
    def write_lifetime(self) -> float:
        """How long a failed write may still land: see :attr:`orphan_lifetime` (the writer aborts the endpoint of
        a failed write, which closes its TCP socket just as a process's end does)."""
        return self.orphan_lifetime

    @property
    def orphan_lifetime(self) -> float:
        """How long the writes of a writer that is gone (its process ended, or it aborted the endpoint) may still
        land here. Where UCX does not use TCP, 2 s: what was already sent is taken at once by a running owner.

        Over TCP the writer's socket is closed gracefully (UCX sets no ``SO_LINGER``; the kernel closes a dead
        process's sockets the same way), and its kernel goes on retransmitting what was queued, about 102 s by
        default (:func:`~aioembed.transports.tcp_orphans.orphan_retransmit_horizon`): a partition that heals
        meanwhile delivers it. What lands is what matches a receive this owner posted into its pool, and the owner
        does not cancel those in time. It learns that the writer went away only from the connection: the FIN comes
        after the queued bytes; across a partition its kernel gives up on the connection after ~15 min where it
        has unacknowledged data in flight (an ACK, UCX's keepalive message: ``tcp_retries2``), 28 s at best.
        Its own stall timer aborts the connection ``write_timeout`` (30 s by default) after the last progress,
        but only while a write is being received: an idle connection has none, and an eager write's header and
        payloads travel together, so a header still queued at the writer arrives with its payloads after the
        heal, and the owner posts receives for it into memory that is registered (the check it makes), however
        the blocks were handed out since. So the lifetime covers the retransmission horizon (+ 2 s): once that is
        over, the closed socket is gone and nothing of it can arrive, whatever is still posted. ``tcp_orphan_seconds``
        lowers it where no partition can hold packets (every process on one host)."""
        if self._orphan_horizon is not None:
            return max(self.capabilities.orphan_lifetime, self._orphan_horizon + 2.0)
        return self.capabilities.orphan_lifetime

    @property
    def connections(self) -> int:
        """Incoming connections open now, as the owning side (at most ``max_connections``)."""
        return 0 if self._listener is None else self._listener.connections

    @property
    def connections_refused(self) -> int:
        """Incoming connections closed at once because ``max_connections`` were open."""
        listener = self._listener
        return self._connections_refused_before + (0 if listener is None else listener.connections_refused)

    @property
    def port(self) -> int | None:
        """The listener's port, once ``descriptor()`` has started it."""
        return None if self._listener is None else self._listener.port

    @classmethod
    async def open(cls, options: Mapping[str, Any]) -> Self:
        try:
            lib: str | None = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            lib = None
        if lib != "asyncio":
            raise ConfigError(
                f"transport 'ucx' works only under asyncio (ucxx drives UCX from an asyncio event loop), "
                f"but this code runs under {lib or 'no async library'}; run under asyncio (or uvloop), "
                "or choose another transport"
            )
        opts = UcxOptions.parse(options)
        await anyio.to_thread.run_sync(load_ucxx)  # off the loop: the first import loads UCX (~0.7 s)
        ucxx = ensure_context(opts)
        host = opts.host
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        except OSError:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise ConfigError(f"transport_options.host={host!r} does not resolve: {exc}") from exc
            infos.sort(key=lambda i: i[0] != socket.AF_INET)
            host = str(infos[0][4][0])
        return cls(opts, ucxx, host)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """:meth:`UcxOptions.parse`, what :meth:`open` parses with: no UCX context, no listener. A host name is
        resolved only at open."""
        UcxOptions.parse(options)

    def _check_open(self) -> None:
        if self.closed:
            raise TransportError(f"ucx endpoint {self.id[:8]} is closed")

    def reads_unregistered(self, device: str) -> bool:
        """ucxx sends from any host memory (UCX registers what a protocol needs itself, in its cache): this
        plugin's registration only records each region's device. So where UCX has no RDMA transport to use (the
        context's TLS names none, or UCX chooses on a host without RDMA devices), a CPU source needs nothing, and
        the sender writes from the caller's tensors as they are. Over RDMA a send from memory UCX has not seen
        costs a pin, which the sender's staging area (registered, so hot in UCX's cache) avoids for small
        requests: false there. False in ucxx's ``thread`` progress modes too: there the abort of a failed write's
        endpoint is handed to the progress thread and may give up with sends still posted, so a source must not
        depend on the write lifetime alone (staged rows live as long as the sender). False for CUDA sources
        (registered, for their device)."""
        return self._unregistered_cpu and device == "cpu"

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        self._check_open()
        for r in regions:
            _check_device(r)
            if r.device != "cpu" and (problem := self.options.cuda_problem(os.environ)) is not None:
                # Refused here, not as a ucxx ValueError in the middle of a write.
                raise ConfigError(f"ucx transport cannot move {r.device} memory: {problem}")
        # The checkpoint comes first: a cancel delivered there raises with nothing recorded. Recorded first, a
        # register() that raised left its regions announced, never to be unregistered by a caller told it failed.
        await asyncio.sleep(0)
        self._check_open()
        self._memory.add(list(regions))

    async def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        self._check_open()
        await asyncio.sleep(0)  # before the change, as in register(): one that raises has changed nothing
        self._check_open()
        self._memory.remove(list(regions))

    def descriptor(self) -> bytes:
        self._check_open()
        self._ensure_listener()
        return msgpack.packb({
            "transport": self.name,
            "v": _DESCRIPTOR_VERSION,
            "endpoint": self.id,
            "host": self.host,
            "port": self.port,
            "regions": [[r.address, r.length, r.device] for r in self._memory.all],
            "eager": self.options.eager_bytes,
        })

    def _ensure_listener(self) -> None:
        if self._listener is not None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise TransportError("ucx: descriptor() must be called on the event loop the endpoint was opened on")
        try:
            # Not ucxx's create_listener: its handshake polls on every loop turn while a peer keeps it waiting,
            # and its timeout path frees buffers UCX still writes into (see _listener).
            self._listener = Listener(self._ucxx, self.options.port, self._accept,
                                      handshake_timeout=self.options.connect_timeout,
                                      max_connections=self.options.max_connections)
        except Exception as exc:
            raise TransportError(f"ucx endpoint {self.id[:8]} cannot listen on port {self.options.port}: "
                                 f"{exc!r}") from exc
        log.info("ucx endpoint %s listening on 0.0.0.0:%s, announced as %s", self.id[:8], self.port, self.host)

    async def connect(self, peer_descriptor: bytes) -> UcxLink:
        self._check_open()
        peer = _parse_descriptor(peer_descriptor)
        ep = await self._open_endpoint(peer)
        if self.closed:  # closed while it connected: its close saw no link to end, so the endpoint ends here
            _abort(ep)
            raise TransportError(f"ucx endpoint {self.id[:8]} was closed while it connected to {peer.name}",
                                 may_land=False)
        link = UcxLink(self, peer, ep)
        self._links.add(link)
        return link

    async def _open_endpoint(self, peer: _Peer) -> Any:
        """A UCX endpoint to ``peer`` whose listener confirmed that it is ``peer.endpoint``."""
        timeout = self.options.connect_timeout
        ep: Any = None
        try:
            async with asyncio.timeout(timeout):
                ep = await _create_endpoint(self._ucxx, peer.host, peer.port)
                body = msgpack.packb({"endpoint": peer.endpoint})
                await tag_send(ep, w.PREFIX.pack(w.MAGIC, w.VERSION, w.KIND_HELLO, 0, len(body)), w.T_PREFIX)
                await tag_send(ep, body, w.t_body(0))
                reply = bytearray(w.REPLY_SIZE)
                await tag_recv(ep, reply, w.t_reply(0))
                status, message = w.decode_reply(reply)
        # may_land=False below: no write was posted on an endpoint that never passed its HELLO.
        except TimeoutError:
            _abort(ep)
            raise TransportError(f"cannot connect to {peer.name}: no answer within "
                                 f"connect_timeout={timeout} s", may_land=False) from None
        except self._errors as exc:
            _abort(ep)
            # A receiver at its max_connections closes a new connection before the UCX handshake: the writer
            # sees what it sees of a port nobody listens on (a zero-length peer-info message), so both are named.
            raise TransportError(f"cannot connect to {peer.name}: {exc!r} (is the peer running and reachable on "
                                 "that address, and below its transport_options.max_connections? A receiver "
                                 "closes connections past that at once)", may_land=False) from exc
        except BaseException:
            _abort(ep)
            raise
        if status != w.OK:
            _abort(ep)
            raise TransportError(f"{peer.name} refused the connection: {message}", may_land=False)
        return ep

    async def aclose(self) -> None:
        # Shielded (CloseOnce): ``closed`` is set at once, so a close cut short by a cancellation could never
        # be retried (the listener's port, the links and their UCX endpoints would stay open for good).
        await self._closing.run(self._close)

    async def _close(self) -> None:
        self.closed = True
        for link in list(self._links):
            await link.aclose()
        tasks = list(self._serving)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for ep in list(self._server_eps):
            _abort(ep)
        self._server_eps.clear()
        # Before the listener goes: a buried request still kept would keep its endpoint, and that one the listener.
        await settle_graveyard(self.options.connect_timeout)
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await listener.aclose()  # and the handshakes still under way
            self._connections_refused_before += listener.connections_refused
        self._memory = _Memory()

    # -- the owning side -----------------------------------------------------------------

    async def _accept(self, ep: Any) -> None:
        """Listener callback (on our loop): serve one connection until it ends or we close."""
        task = asyncio.current_task()
        if self.closed or task is None:
            _abort(ep)
            return
        self._serving.add(task)
        self._server_eps.add(ep)
        try:
            await self._serve(ep)
        except asyncio.CancelledError:
            pass
        except self._errors as exc:
            log.debug("ucx endpoint %s: connection ended: %r", self.id[:8], exc)
        except Exception:
            log.exception("ucx endpoint %s: connection handler failed", self.id[:8])
        finally:
            self._serving.discard(task)
            self._server_eps.discard(ep)
            _abort(ep)

    async def _serve(self, ep: Any) -> None:
        writes: set[asyncio.Task[None]] = set()
        progress = _Progress()
        budget = BodyBudget(BODY_BUDGET)
        timeout = self.options.write_timeout
        try:
            while True:
                prefix = bytearray(w.PREFIX.size)
                await tag_recv(ep, prefix, w.T_PREFIX)
                progress.tick()
                magic, version, kind, wid, body_len = w.PREFIX.unpack(prefix)
                if magic != w.MAGIC or version != w.VERSION or kind not in _KINDS or body_len > w.MAX_BODY:
                    log.warning("ucx endpoint %s: dropping a connection that sent a bad header "
                                "(magic %r, version %d, kind %d, body %d bytes)",
                                self.id[:8], bytes(magic), version, kind, body_len)
                    return
                if not self._take_body_now(budget, body_len):
                    log.debug("ucx endpoint %s: write %d (%d header bytes) waits for writes in progress to end (%d "
                              "bytes held on its connection, %d on this endpoint)", self.id[:8], wid, body_len,
                              budget.held, self._body_budget.held)
                    # Waiting for budget is no progress: a peer whose writes (or, for the endpoint's budget,
                    # everyone's) do not end within write_timeout is dropped, with or without a write in progress.
                    # (The usual write takes its budget at once, above: no scope or timer for it.)
                    with _StallTimeout(progress, timeout) as stall:
                        await self._take_body(budget, body_len)
                    if stall.expired:
                        log.warning("ucx endpoint %s: write %d waited write_timeout=%s s for room for its %d header "
                                    "bytes (%d held on its connection, %d on this endpoint); dropping the "
                                    "connection", self.id[:8], wid, timeout, body_len, budget.held,
                                    self._body_budget.held)
                        return
                t = asyncio.create_task(self._serve_one(ep, progress, kind, wid, body_len))
                writes.add(t)
                t.add_done_callback(writes.discard)
                t.add_done_callback(functools.partial(_give_back, (budget, self._body_budget), body_len))
        finally:
            for t in writes:
                t.cancel()
            if writes:
                await asyncio.gather(*writes, return_exceptions=True)

    def _take_body_now(self, budget: BodyBudget, body_len: int) -> bool:
        """Take a write's body from its connection's budget and the endpoint's if both have room now (or neither)."""
        if not budget.try_take(body_len):
            return False
        if self._body_budget.try_take(body_len):
            return True
        budget.give(body_len)
        return False

    async def _take_body(self, budget: BodyBudget, body_len: int) -> None:
        """Take a write's body from its connection's budget, then from the endpoint's (both or neither)."""
        await budget.take(body_len)
        try:
            await self._body_budget.take(body_len)
        except BaseException:
            budget.give(body_len)
            raise

    def _count_body_bytes(self, delta: int) -> None:
        self.body_bytes_held += delta

    async def _serve_one(self, ep: Any, progress: _Progress, kind: int, wid: int, body_len: int) -> None:
        timeout = self.options.write_timeout
        try:
            with _StallTimeout(progress, timeout) as stall:
                await self._receive_write(ep, progress, kind, wid, body_len)
        except self._errors as exc:
            # The wire state is unknown (other receives of the write may still be posted): end the
            # connection, which cancels them; the writer's write fails and it reconnects.
            log.debug("ucx endpoint %s: write %d failed: %r; aborting the connection", self.id[:8], wid, exc)
            _abort(ep)
            return
        except Exception:
            # Not UCX's (say, a MemoryError for a peer's oversized write): this task is nobody's to report
            # to, so log it here, and end the connection (the writer learns at once instead of at its timeout).
            log.exception("ucx endpoint %s: write %d failed unexpectedly; aborting the connection", self.id[:8], wid)
            _abort(ep)
            return
        if stall.expired:
            # The writer is frozen or gone: its data may never come. Abort the connection, which
            # cancels our receives into the pool (the writer's write fails on its own timeout).
            log.warning("ucx endpoint %s: write %d made no progress within write_timeout=%s s; "
                        "aborting the connection", self.id[:8], wid, timeout)
            _abort(ep)

    async def _receive_write(self, ep: Any, progress: _Progress, kind: int, wid: int, body_len: int) -> None:
        pending: list[Posted] = []
        try:
            body = bytearray(body_len)
            if body_len:
                await tag_recv(ep, body, w.t_body(wid))
                progress.tick()
            if kind == w.KIND_HELLO:
                await self._answer_hello(ep, wid, body)
                return
            eager = kind == w.KIND_EAGER
            # Each op writes at least one byte of memory registered here (an eager write's ops at most
            # eager_bytes in all), and ops of one write that overlap leave undefined bytes: a body announcing more
            # ops than that is refused before millions of them are unpacked and checked on the loop.
            max_ops = self.options.eager_bytes if eager else self._memory.nbytes
            try:
                direct_spans, inline = w.decode_ops(body, max_ops)
            except ValueError as exc:
                if eager:  # its data messages cannot be told apart from the next write's: end the connection
                    log.warning("ucx endpoint %s: malformed eager write %d (%s); dropping the connection",
                                self.id[:8], wid, exc)
                    _abort(ep)
                    return
                if isinstance(exc, w.TooManyOps):
                    reason = (f"{exc}: more ops than the bytes registered at ucx endpoint {self.id[:8]}, so some "
                              "would overlap or fall outside the memory registered")
                else:
                    reason = f"malformed write header: {exc}"
                log.warning("ucx endpoint %s: refused write %d: %s", self.id[:8], wid, reason)
                await tag_send(ep, w.encode_reply(w.REFUSED, reason), w.t_reply(wid))
                return
            size = sum(n for _, n in (*direct_spans, *inline))
            if eager and size > self.options.eager_bytes:
                # Not a write this endpoint agreed to buffer on refusal (its descriptor says how much).
                log.warning("ucx endpoint %s: eager write %d of %d bytes is over the announced eager_bytes=%d; "
                            "dropping the connection", self.id[:8], wid, size, self.options.eager_bytes)
                _abort(ep)
                return
            try:
                direct = self._check_destinations(direct_spans, inline)
            except TransportError as exc:
                log.warning("ucx endpoint %s: refused write %d: %s", self.id[:8], wid, exc)
                if eager:
                    # The data is on its way already: take it into scratch memory, never into ours.
                    scratch = [bytearray(n) for _, n in direct_spans]
                    if inline:
                        scratch.append(bytearray(sum(n for _, n in inline)))
                    pending = [post(ep, buf, w.t_data(wid, i), send=False) for i, buf in enumerate(scratch)]
                    await wait_posted(pending, progress.tick)
                    await tag_send(ep, w.encode_reply(w.REFUSED, str(exc)), w.t_ack(wid))
                else:
                    await tag_send(ep, w.encode_reply(w.REFUSED, str(exc)), w.t_reply(wid))
                return
            # Post every receive straight into the pool, then (unless eager) tell the writer to go.
            pending = [post(ep, buf, w.t_data(wid, i), send=False) for i, buf in enumerate(direct)]
            blob = None
            if inline:
                blob = bytearray(sum(n for _, n in inline))
                pending.append(post(ep, blob, w.t_data(wid, len(direct)), send=False))
            if not eager:
                pending.append(post(ep, w.encode_reply(w.OK), w.t_reply(wid), send=True))
            await wait_posted(pending, progress.tick)
            if blob is not None:
                off = 0
                for dst, n in inline:
                    ctypes.memmove(dst, (ctypes.c_char * n).from_buffer(blob, off), n)
                    off += n
            self.writes_received += 1
            self.eager_writes_received += eager
            await tag_send(ep, w.encode_reply(w.OK), w.t_ack(wid))
        except BaseException:
            # The connection is aborted next; until UCX has cancelled what is still posted, keep its buffers.
            bury_posted(ep, pending)
            raise
        finally:
            cancel_posted(pending)

    async def _answer_hello(self, ep: Any, wid: int, body: bytearray) -> None:
        try:
            want = msgpack.unpackb(bytes(body), raw=False).get("endpoint")
        except Exception:
            want = None
        if want != self.id:
            await tag_send(ep, w.encode_reply(w.REFUSED, f"this listener is ucx endpoint {self.id[:8]}, not "
                                                         f"{str(want)[:8]} (did the peer restart?)"), w.t_reply(wid))
            return
        await tag_send(ep, w.encode_reply(w.OK, self.id), w.t_reply(wid))

    def _check_destinations(self, direct: Sequence[tuple[int, int]], inline: Sequence[tuple[int, int]]) -> list[object]:
        """Check every destination against the memory registered *now*, before receiving a byte into it;
        the buffers to receive the direct ops into."""
        if self.closed:
            raise TransportError(f"ucx endpoint {self.id[:8]} is closing")
        bufs = []
        for dst, n in direct:
            device = self._memory.device_of(dst, n) if n > 0 else None
            if device is None:
                raise TransportError(f"destination [{dst:#x}, +{n}) is outside the memory registered "
                                     f"at ucx endpoint {self.id[:8]}")
            bufs.append(_buffer(dst, n, device))
        for dst, n in inline:
            if n <= 0 or self._memory.by_device.get("cpu") is None or not self._memory.by_device["cpu"].covers(dst, n):
                raise TransportError(f"inline destination [{dst:#x}, +{n}) is outside the CPU memory "
                                     f"registered at ucx endpoint {self.id[:8]}")
        return bufs


_KINDS = frozenset({w.KIND_HELLO, w.KIND_WRITE, w.KIND_EAGER})


def _give_back(budgets: tuple[BodyBudget, ...], nbytes: int, _task: asyncio.Task[None]) -> None:
    for budget in budgets:
        budget.give(nbytes)


class _Progress:
    """When a connection last showed that its peer is alive (a message of it completed)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = time.monotonic()

    def tick(self, _: object = None) -> None:
        self.last = time.monotonic()


class _StallTimeout:
    """``with _StallTimeout(progress, timeout) as stall:`` cancels what runs inside once neither it nor
    anything else on the connection has made progress for ``timeout`` seconds; ``stall.expired`` says so
    afterwards. (Writes queued behind others on a busy but live connection do not time out; a frozen
    peer fails every pending write after ``timeout``.) One timer, no task: the work runs in the caller's
    task."""

    __slots__ = ("_handle", "_loop", "_progress", "_start", "_timeout", "expired", "scope")

    def __init__(self, progress: _Progress, timeout: float) -> None:
        self._progress = progress
        self._timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._start = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self.scope = anyio.CancelScope()
        self.expired = False

    def __enter__(self) -> Self:
        self.scope.__enter__()
        self._start = time.monotonic()
        self._handle = self._loop.call_later(self._timeout, self._check)
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        if self._handle is not None:
            self._handle.cancel()
        swallowed = bool(self.scope.__exit__(*exc_info))
        # Fired as the work was finishing, without an await left to cancel: it finished, not timed out.
        self.expired = self.expired and self.scope.cancelled_caught
        return swallowed

    def _check(self) -> None:
        remaining = max(self._start, self._progress.last) + self._timeout - time.monotonic()
        if remaining > 0:
            self._handle = self._loop.call_later(remaining, self._check)
            return
        self._handle = None
        self.expired = True
        self.scope.cancel()




async def _create_endpoint(ucxx: Any, host: str, port: int) -> Any:
    """``ucxx.create_endpoint`` without its use-after-free on timeout (cancel this freely)."""
    import importlib
    import os
    import struct

    # ucxx internals (untyped), as used by ApplicationContext.create_endpoint in ucxx 0.52
    ucx_api = importlib.import_module("ucxx._lib.libucxx")
    Array = importlib.import_module("ucxx._lib.arr").Array
    Endpoint = importlib.import_module("ucxx._lib_async.endpoint").Endpoint
    hash64bits = importlib.import_module("ucxx._lib_async.utils").hash64bits

    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress()
    ucx_ep = ucx_api.UCXEndpoint.create(ctx.worker, host, port, True)
    if not ctx.progress_mode.startswith("thread"):
        ctx.worker.progress()
    msg_tag = hash64bits("msg_tag", os.urandom(16), ucx_ep.handle)
    mine = struct.pack("QQ", msg_tag, hash64bits(msg_tag))
    theirs = bytearray(16)
    mine_arr, theirs_arr = Array(mine), Array(theirs)
    try:
        await wait_request(ucx_ep.stream_recv(theirs_arr))
        await wait_request(ucx_ep.stream_send(mine_arr))
    except BaseException:
        _GRAVEYARD.bury(ucx_ep, mine, theirs, mine_arr, theirs_arr)
        # Not close_blocking (it left an endpoint with its receive posted alive for good: see close_posted);
        # the graveyard keeps the endpoint until UCX closed it.
        with contextlib.suppress(Exception):
            close_posted(ucx_ep)
        raise
    peer_tag, checksum = struct.unpack("QQ", theirs)
    if checksum != hash64bits(peer_tag):
        close_at_once(ucx_ep)  # nothing posted on it any more
        raise TransportError(f"UCX peer-info checksum mismatch from {host}:{port}")
    return Endpoint(endpoint=ucx_ep, ctx=ctx, tags={"msg_send": peer_tag, "msg_recv": msg_tag})


def _rdma_devices() -> bool:
    """Whether this host has RDMA devices (what UCX's ``ib``/``rc`` transports would use)."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def _abort(ep: Any) -> None:
    if ep is None:
        return
    with contextlib.suppress(Exception):
        ep.abort()
    with contextlib.suppress(RuntimeError):  # no running loop (a finaliser): nothing to progress here
        kick()  # close it now, not at the next event: the peer learns at once that the connection ended


class _Refused(TransportError):
    """The owning side refused a write: nothing of it was received into the owner's memory, and nothing
    can be later (it refused before any data was sent, or, for an eager write, after it had taken all
    of the data into scratch memory)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, may_land=False)


class UcxLink(Link):
    """Writes into one peer's announced memory over one UCX endpoint (reopened after a failure)."""

    def __init__(self, local: UcxTransport, peer: _Peer, ep: Any) -> None:
        self._local = local
        self._peer = peer
        self._ep: Any = ep
        self._closed = False
        self._wids = itertools.count(1)
        self._reconnect = asyncio.Lock()
        self._progress = _Progress()

    @property
    def peer(self) -> str:
        return self._peer.name

    async def aclose(self) -> None:
        self._closed = True
        self._local._links.discard(self)
        ep, self._ep = self._ep, None
        _abort(ep)
        await asyncio.sleep(0)

    def _drop(self, ep: Any) -> None:
        """Abort the endpoint a failed write used (None: it had none yet); the next write opens a new one."""
        if ep is not None and self._ep is ep:
            self._ep = None
        _abort(ep)

    async def _endpoint(self) -> Any:
        if self._ep is not None:
            return self._ep
        async with self._reconnect:
            if self._ep is None:
                if self._closed or self._local.closed:
                    raise TransportError(f"write on a closed link to {self.peer}", may_land=False)
                ep = await self._local._open_endpoint(self._peer)
                if self._closed or self._local.closed:
                    # Closed while it connected: a write on it would go on after aclose() returned (reading
                    # memory its caller may free then), on an endpoint nothing would ever abort.
                    _abort(ep)
                    raise TransportError(f"write on a closed link to {self.peer} (closed while it reconnected)",
                                         may_land=False)
                self._ep = ep
                self._progress.tick()
                log.info("ucx link to %s reconnected", self.peer)
            return self._ep

    async def write(self, ops: Sequence[WriteOp]) -> None:
        local = self._local
        if self._closed or local.closed:
            raise TransportError(f"write on a closed link to {self.peer}", may_land=False)
        checked: list[tuple[int, int, int, str, str]] = []
        for op in ops:
            if op.length <= 0:
                raise TransportError(f"write op with non-positive length: {op}")
            sdev = local._memory.device_of(op.src, op.length)
            if sdev is None:
                if not local._unregistered_cpu:
                    raise TransportError(f"write source [{op.src:#x}, +{op.length}) is outside every region "
                                         f"registered at this ucx endpoint", may_land=False)
                sdev = "cpu"  # read unregistered (reads_unregistered: the sessions pass only CPU memory so)
            ddev = self._peer.memory.device_of(op.dst, op.length)
            if ddev is None:
                raise TransportError(f"write destination [{op.dst:#x}, +{op.length}) is outside the regions "
                                     f"{self.peer} announced")
            checked.append((op.src, op.dst, op.length, sdev, ddev))
        if not checked:
            await asyncio.sleep(0)
            return
        merged = _coalesce(checked)
        limit = local.options.inline_bytes
        direct = [(s, d, n, sd) for s, d, n, sd, dd in merged if not (n <= limit and sd == dd == "cpu")]
        inline = [(s, d, n) for s, d, n, sd, dd in merged if n <= limit and sd == dd == "cpu"]
        total = sum(o.length for o in ops)
        # Without the owner's go-ahead: small CPU-to-CPU writes, up to what the owner announced it takes so.
        eager = total <= min(local.options.eager_bytes, self._peer.eager_bytes) and all(
            sd == dd == "cpu" for _, _, _, sd, dd in merged)
        held: list[asyncio.CancelledError] = []  # the caller's cancellation, held back while the write ran
        try:
            await self._write(direct, inline, eager, f"write of {total} bytes ({len(merged)} ops) to {self.peer}",
                              held)
        except (Exception, asyncio.CancelledError) as exc:
            if held and exc is not held[0]:
                raise held[0] from exc
            raise
        if held:
            raise held[0]  # the write landed; the caller was cancelled meanwhile

    async def _write(self, direct: Sequence[tuple[int, int, int, str]], inline: Sequence[tuple[int, int, int]],
                     eager: bool, what: str, held: list[asyncio.CancelledError]) -> None:
        """The write, on the link's endpoint. Once something of it is posted it runs to its end, shielded from
        the caller's cancellation (kept in ``held``): giving up then means aborting the endpoint, which every
        other write on the link shares and fails with. Only a stall, or a failure, aborts it."""
        timeout = self._local.options.write_timeout
        shield = anyio.CancelScope()
        ep: Any = None
        try:
            # The stall's scope inside the shield: the shield holds off only cancellations from outside.
            with shield, _StallTimeout(self._progress, timeout) as stall:
                ep = await self._endpoint()  # cancelled here: nothing posted (a new endpoint is aborted)
                shield.shield = True  # no await since: nothing of the write is posted yet
                await self._write_on(ep, direct, inline, eager, stall=stall, held=held)
        except _Refused:
            raise
        except TransportError:
            self._drop(ep)
            raise
        except self._local._errors as exc:
            self._drop(ep)
            raise TransportError(f"{what} failed: {exc!r}") from exc
        except BaseException:
            # Not a cancellation of the caller once the write was posted (_wait holds those back): one before
            # (ep is None), one that raced the stall, or worse; the wire state is unknown, so abort the
            # endpoint, which also cancels the owning side's receives into its pool.
            self._drop(ep)
            raise
        if stall.expired:
            self._drop(ep)
            raise TransportError(f"{what} did not complete: no progress on the link within write_timeout={timeout} "
                                 "s; the UCX endpoint was aborted")

    async def _wait(self, posted: Sequence[Posted], stall: _StallTimeout, held: list[asyncio.CancelledError]) -> None:
        """Until ``posted`` completed (see :func:`wait_posted`). A cancellation of the caller does not stop it
        (it is kept in ``held``, for write() to raise at the end); the stall does. The shield holds off anyio's
        cancellations (but one already delivered as it went up); asyncio's (``Task.cancel``) pass any shield."""
        while True:
            try:
                await wait_posted(posted, self._progress.tick)
                return
            except asyncio.CancelledError as exc:
                if stall.expired:
                    raise
                if not held:
                    held.append(exc)

    async def _write_on(self, ep: Any, direct: Sequence[tuple[int, int, int, str]],
                        inline: Sequence[tuple[int, int, int]], eager: bool, *, stall: _StallTimeout,
                        held: list[asyncio.CancelledError]) -> None:
        # Every message of a step is posted at once (in wire order) and awaited together in this task.
        wid = next(self._wids)
        body = w.encode_ops([(d, n) for _, d, n, _ in direct], [(d, n) for _, d, n in inline])
        kind = w.KIND_EAGER if eager else w.KIND_WRITE
        posted: list[Posted] = []  # all this write posted: kept with the endpoint if the write fails midway
        ack = bytearray(w.REPLY_SIZE)
        ack_recv: list[Posted] = []
        try:
            posted += [post(ep, w.PREFIX.pack(w.MAGIC, w.VERSION, kind, wid, len(body)), w.T_PREFIX, send=True),
                       post(ep, body, w.t_body(wid), send=True)]
            if not eager:
                reply = bytearray(w.REPLY_SIZE)
                posted.append(post(ep, reply, w.t_reply(wid), send=False))
                await self._wait(posted, stall, held)
                status, message = w.decode_reply(reply)
                if status != w.OK:
                    raise _Refused(f"{self.peer} refused the write: {message}")
            ack_recv.append(post(ep, ack, w.t_ack(wid), send=False))
            sends = [post(ep, _buffer(s, n, sd), w.t_data(wid, i), send=True) for i, (s, _, n, sd) in enumerate(direct)]
            if inline:
                blob = bytearray(sum(n for _, _, n in inline))
                off = 0
                for s, _, n in inline:
                    ctypes.memmove((ctypes.c_char * n).from_buffer(blob, off), s, n)
                    off += n
                sends.append(post(ep, blob, w.t_data(wid, len(direct)), send=True))
            posted += sends
            await self._wait(posted, stall, held)  # the go-ahead's messages completed already, if any
            await self._wait(ack_recv, stall, held)
        except _Refused:
            raise  # before any data was posted, with everything it posted completed
        except BaseException:
            # The endpoint is aborted next; until UCX has cancelled what is still posted, keep its buffers.
            bury_posted(ep, [*posted, *ack_recv])
            raise
        finally:
            cancel_posted(ack_recv)  # only the wait for the answer (as before: sends end with the endpoint)
        status, message = w.decode_reply(ack)
        if status == w.REFUSED:  # an eager write: the owner took the data into scratch memory, not its own
            raise _Refused(f"{self.peer} refused the write: {message}")
        if status != w.OK:
            raise TransportError(f"{self.peer} could not complete the write: {message}")
