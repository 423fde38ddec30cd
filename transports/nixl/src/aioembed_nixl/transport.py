"""The ``nixl`` transport: aioembed's Transport / Link on a NIXL agent (one-sided writes).

An endpoint is one NIXL agent with one backend (UCX by default). The receiver registers its pool
and announces it in a msgpack descriptor that carries NIXL's agent metadata; a sender loads that
metadata (``add_remote_agent``) and writes straight into the pool: the owner takes no part in a
write, beyond its UCX worker being progressed by NIXL's progress thread (needed over TCP).

Every NIXL call runs on the endpoint's worker thread (:mod:`aioembed_nixl._worker`), which also
waits for completion: ``Link.write`` returns once ``check_xfer_state`` said DONE on this side (the
initiator), which for a NIXL write means the bytes are in the peer's memory. NIXL notifications are
not used: a notification says a message arrived, not that a transfer completed.

Works under asyncio and trio. What NIXL cannot do (cancel a posted write, cut off a writer) and what
the plugin declares for it is in the README.
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Self

import anyio
import anyio.to_thread
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

from aioembed_nixl._descriptor import check_device, decode, encode
from aioembed_nixl._engine import Engine, LinkState
from aioembed_nixl._loop import LoopWaker
from aioembed_nixl._native import Nixl, load_nixl, rdma_devices
from aioembed_nixl._options import NixlOptions
from aioembed_nixl._worker import AgentWorker, WriteJob

__all__ = ["NixlLink", "NixlTransport"]

log = logging.getLogger("aioembed.transports.nixl")


def _native(what: str, exc: BaseException, *, may_land: bool | None = None) -> TransportError:
    """A ``TransportError`` for a NIXL failure, naming what was being done (the original is the cause)."""
    err = TransportError(f"{what} failed: {type(exc).__name__}: {exc}", may_land=may_land)
    err.__cause__ = exc
    return err


def _settled(job: WriteJob) -> Callable[[], Awaitable[None]]:
    """How the sender learns that a failed write's transfers ended: the worker tracks them until they do,
    however long a transfer that keeps moving takes (one NIXL lost track of counts ``write_timeout`` more)."""
    return job.wait_settled


def _coalesce(ops: Sequence[WriteOp]) -> list[tuple[int, int, int]]:
    """Merge ops that continue the previous one on both sides."""
    out: list[tuple[int, int, int]] = []
    for op in ops:
        if out:
            s, d, n = out[-1]
            if s + n == op.src and d + n == op.dst:
                out[-1] = (s, d, n + op.length)
                continue
        out.append((op.src, op.dst, op.length))
    return out


class NixlTransport(Transport):
    """Endpoint of the ``nixl`` transport: one NIXL agent. Options: see :class:`NixlOptions`."""

    name: ClassVar[str] = "nixl"
    capabilities = TransportCapabilities(
        cuda=True,  # the cu12/cu13 builds register VRAM through UCX; refused at register() where it cannot work
        asyncio_only=False,
        cross_process=True,
        # A posted NIXL write cannot be cancelled: releasing its handle or removing the peer's metadata
        # does not stop it, and it keeps landing (measured: README). Only destroying the agent stops it.
        cancel_safe_writes=False,
        # Nothing the owner can call stops a writer: remove_remote_agent and deregister_memory on the owner
        # leave later writes landing, and shared-memory writes (cma) need no help from the owner at all.
        revocable=False,
        write_lifetime=30.0,  # per endpoint: write_timeout, over TCP at least the orphan horizon (see the property)
        # A writer whose process ended: its kernel still delivers what it had sent (socket buffers). Over shared
        # memory (cma) and RDMA; over TCP per endpoint, much longer (see the property).
        orphan_lifetime=2.0,
    )

    def __init__(self, options: NixlOptions, nixl: Nixl, worker: AgentWorker, engine: Engine) -> None:
        self.options = options
        self.nixl = nixl
        self.agent_name = engine.name
        self.closed = False
        self._closing = CloseOnce()
        self._worker = worker
        self._engine = engine
        self._regions = RegionSet()
        self._devices: dict[str, RegionSet] = {}
        self._links: set[NixlLink] = set()
        self._reg_lock = anyio.Lock()
        self._orphan_horizon = options.orphan_horizon(os.environ)
        """Over TCP, how long a closed socket's bytes may still land here (None: no TCP): see :attr:`orphan_lifetime`.
        ``UCX_TLS`` is read as UCX read it when the backend was created (just now, in :meth:`open`)."""
        self._quick_registration = options.backend == "UCX" and not rdma_devices()
        """Registering CPU memory pins nothing (UCX with no RDMA device to register it with): a call of about
        10 us, made on the event loop when the worker thread is idle (:meth:`_registration_call`)."""
        # An endpoint dropped without aclose(): its agent is torn down on its thread as aclose() would do it,
        # writes still in flight settled only once the agent is destroyed, and then the thread ends. Stopping
        # the thread alone settled them at once while the writes' own records kept the agent alive, and the
        # bytes went on landing. Not at interpreter exit: the process ending stops every transfer, and a
        # teardown racing the interpreter's shutdown on a daemon thread is worse than none.
        self._dropped = weakref.finalize(self, worker.stop_after, lambda: engine.teardown(worker))
        self._dropped.atexit = False

    def __repr__(self) -> str:
        return f"<NixlTransport {self.agent_name} {self.options.backend} {'closed' if self.closed else 'open'}>"

    @property
    def regions(self) -> RegionSet:
        """Every registered region (with repeats), for inspection."""
        return self._regions

    @property
    def write_lifetime(self) -> float:
        """A write that failed keeps moving (NIXL cannot abort it). Its error says when its transfers ended
        (``settled``: the worker tracks them); this covers the rest (a NIXL call that raised mid-transfer),
        and is the floor of that wait: as long again as the write was given. Over TCP at least
        :attr:`orphan_lifetime`: a transfer that ended because UCX closed its connection, or because the agent
        was destroyed, leaves what the socket had queued with the kernel (see there)."""
        lifetime = self.options.write_timeout
        if self._orphan_horizon is not None:
            lifetime = max(lifetime, self._orphan_horizon + 2.0)
        return lifetime

    @property
    def orphan_lifetime(self) -> float:
        """How long the writes of a writer whose process ended (or whose agent was destroyed, or whose UCX closed
        the connection) may still land here. Over shared memory (cma: the copy is done inside ``transfer()``) and
        RDMA (the kernel destroys the queue pairs), what was already sent: 2 s. Over TCP, what the writer's kernel
        goes on retransmitting for the closed socket (graceful: UCX sets no ``SO_LINGER``; a destroyed agent still
        delivered 7.9 % of a 256 MiB write, see the README), about 102 s by default: a partition healing meanwhile
        delivers it, and this (passive) owner's UCX worker reads an RMA put straight from the socket into the
        registered address (``uct_tcp_ep_progress_put_rx``: ``recv`` into ``put_req->addr``). Nothing closes the
        owner's end first: it learns of the writer's end only from the socket, after the queued bytes (the FIN
        follows them), or from its kernel giving up on a silent peer, which takes 28 s at best (UCX's keepalive,
        10 s idle + 9 probes 2 s apart, set only on connections this side opened) and ~15 min where it has
        unacknowledged data of its own in flight (a put's ACK, UCX's keepalive message: ``tcp_retries2``)."""
        if self._orphan_horizon is not None:
            return self._orphan_horizon + 2.0
        return self.capabilities.orphan_lifetime

    @property
    def writer_id(self) -> str:
        return self.agent_name

    @property
    def worker(self) -> AgentWorker:
        """The endpoint's NIXL thread (for tests and metrics)."""
        return self._worker

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    async def open(cls, options: Mapping[str, Any]) -> Self:
        opts = NixlOptions.parse(options)
        waker = LoopWaker()
        nixl = await anyio.to_thread.run_sync(load_nixl)
        name = f"aioembed-{uuid.uuid4().hex}"
        worker = AgentWorker(name, waker)
        try:
            # A cancelled open() waits for the agent being made, and has it torn down on the worker thread
            # (it would otherwise be left to the garbage collector, NIXL's threads and all).
            engine = await worker.call(lambda: Engine(nixl, name, opts), undo=lambda e: e.teardown(worker))
        except BaseException as exc:
            worker.stop()
            with anyio.CancelScope(shield=True):
                await worker.join()
            if isinstance(exc, Exception) and not isinstance(exc, (ConfigError, TransportError)):
                raise _native(f"nixl: creating agent {name} with backend {opts.backend!r}", exc) from exc
            raise
        log.info("nixl transport: agent %s up (%s, backend %s, memory types %s)", name, nixl.module, opts.backend,
                 engine.mem_types)
        return cls(opts, nixl, worker, engine)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """:meth:`NixlOptions.parse`, what :meth:`open` parses with: NIXL is not loaded. ``backend_params`` keys
        are checked against the backend's own list only at open (that list comes from NIXL)."""
        NixlOptions.parse(options)

    def _check_open(self) -> None:
        if self.closed:
            raise TransportError(f"nixl endpoint {self.agent_name} is closed")

    async def aclose(self) -> None:
        """Tear the agent down now: writes still in flight fail (and stop: destroying the agent is the one
        way to stop a NIXL transfer), registrations are released, NIXL's threads end."""
        await self._closing.run(self._close)

    async def _close(self) -> None:
        self.closed = True
        self._dropped.detach()  # the teardown below is the one
        for link in list(self._links):
            link._closed = True
        self._links.clear()
        engine = self._engine
        try:
            await self._worker.call(lambda: engine.teardown(self._worker))
        except Exception as exc:
            log.warning("nixl agent %s: teardown failed: %s: %s", self.agent_name, type(exc).__name__, exc)
        finally:
            self._worker.stop()
            await self._worker.join()
        self._regions = RegionSet()
        self._devices.clear()

    # -- registration --------------------------------------------------------------------

    def _check_cuda(self, region: MemoryRegion) -> None:
        """Refuse CUDA memory where it cannot work, before NIXL is asked (its errors say little)."""
        if region.device == "cpu":
            return
        if "VRAM_SEG" not in self._engine.mem_types:
            raise ConfigError(f"nixl backend {self.options.backend!r} of this NIXL build ({self.nixl.module}) cannot "
                              f"register {region.device} memory: its memory types are {self._engine.mem_types}")
        import torch

        index = int(region.device.split(":", 1)[1])
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(f"nixl transport cannot register {region.device} memory: this process sees "
                              f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA device(s)")
        if self.options.backend == "UCX" and self.options.ucx_tls and "cuda" not in self.options.ucx_tls \
                and not self.options.ucx_tls.startswith("^"):
            raise ConfigError(f"transport_options.ucx_tls={self.options.ucx_tls!r} has no CUDA transport for "
                              f"{region.device} memory; add cuda_copy (and cuda_ipc), or leave ucx_tls unset")

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        self._check_open()
        regions = list(regions)
        for r in regions:
            check_device(r)
            self._check_cuda(r)
        if not regions:
            await anyio.lowlevel.checkpoint()
            return
        with anyio.CancelScope(shield=True):  # NIXL's registrations and ours must stay in step
            async with self._reg_lock:
                self._check_open()
                new = self._regions.add(regions)
                if new:
                    try:
                        engine = self._engine
                        await self._registration_call(new, lambda: engine.register(new))
                    except BaseException as exc:
                        self._regions.remove(regions)
                        if isinstance(exc, Exception) and not isinstance(exc, (ConfigError, TransportError)):
                            raise _native(f"nixl agent {self.agent_name}: registering {len(new)} region(s), "
                                          f"{sum(r.length for r in new)} bytes", exc) from exc
                        raise
                for r in regions:
                    self._devices.setdefault(r.device, RegionSet()).add([r])

    async def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        self._check_open()
        regions = list(regions)
        with anyio.CancelScope(shield=True):
            async with self._reg_lock:
                self._check_open()
                gone = self._regions.remove(regions)  # raises, removing nothing, for one not registered
                for r in regions:
                    rs = self._devices[r.device]
                    rs.remove([r])
                    if not len(rs):
                        del self._devices[r.device]
                if gone:
                    engine = self._engine
                    try:
                        await self._registration_call(gone, lambda: engine.deregister(gone))
                    except Exception as exc:
                        raise _native(f"nixl agent {self.agent_name}: deregistering {len(gone)} region(s)", exc) \
                            from exc

    async def _registration_call(self, regions: Sequence[MemoryRegion], fn: Callable[[], object]) -> None:
        """``fn()`` (a registration or deregistration of ``regions``) where it is quickest and safe: right here
        if it pins nothing and the worker thread is idle (it then waits for it; a send()'s registration and
        unregistration, one room after another, skip two thread hops each), else on the worker thread."""
        if self._quick_registration and all(r.device == "cpu" for r in regions) and self._worker.call_if_idle(fn):
            return
        await self._worker.call(fn)

    # -- descriptor and links ------------------------------------------------------------

    def descriptor(self) -> bytes:
        self._check_open()
        try:
            metadata = self._engine.metadata()  # a quick local call; NIXL's agent lock makes it thread-safe
        except Exception as exc:
            raise _native(f"nixl agent {self.agent_name}: get_agent_metadata()", exc) from exc
        return encode(self.agent_name, self.options.backend, metadata, list(self._regions))

    async def connect(self, peer_descriptor: bytes) -> NixlLink:
        self._check_open()
        desc = decode(peer_descriptor)
        if desc.backend != self.options.backend:
            raise TransportError(f"nixl peer {desc.agent} uses backend {desc.backend!r}, this endpoint "
                                 f"{self.options.backend!r}; set the same transport_options.backend on both sides")
        engine = self._engine
        try:
            # Cancelled while it runs (a handshake timeout, a close): the link state it made is closed after it.
            state = await self._worker.call(lambda: engine.connect(desc), undo=engine.close_link)
        except Exception as exc:
            raise _native(f"nixl agent {self.agent_name}: connecting to agent {desc.agent}", exc) from exc
        link = NixlLink(self, desc.agent, desc.regions, state)
        if self.closed:
            await link.aclose()
            self._check_open()
        self._links.add(link)
        return link

    # -- writes (called by links) --------------------------------------------------------

    def _device_of(self, address: int, length: int) -> str | None:
        for device, rs in self._devices.items():
            if rs.covers(address, length):
                return device
        return None

    async def _write(self, link: NixlLink, ops: Sequence[WriteOp]) -> None:
        if link._closed or self.closed:
            raise TransportError(f"write on a closed link to {link.peer}")
        for op in ops:
            if op.length <= 0:
                raise TransportError(f"write op with non-positive length: {op}")
            if self._device_of(op.src, op.length) is None:
                raise TransportError(f"write source [{op.src:#x}, +{op.length}) is outside every region registered "
                                     f"at nixl agent {self.agent_name}")
            link._announced.check(op.dst, op.length, f"write destination at {link.peer}")
        if not ops:
            await anyio.lowlevel.checkpoint()
            return
        merged = _coalesce(ops)
        total = sum(n for _, _, n in merged)
        what = f"nixl write of {total} bytes ({len(merged)} ops) from agent {self.agent_name} to {link.peer}"
        engine, state = self._engine, link._state
        job = WriteJob(lambda j: engine.post_write(j, state, merged), self.options.write_timeout, what,
                       peer=link._agent)
        try:
            await self._worker.write(job)
        except TimeoutError as exc:  # the worker's: no progress within write_timeout, or the stall cap
            raise TransportError(
                f"{exc}. NIXL cannot cancel a posted write: it stays in flight (tracked until it ends) and may "
                "still land, so the destination is not reused before it ended",
                may_land=True, settled=_settled(job)) from None
        except Exception as exc:
            hint = " (the peer closed or its process died)" if "Disconnect" in type(exc).__name__ else ""
            err = _native(what + hint, exc, may_land=job.may_land)
            err.settled = _settled(job) if job.may_land else None
            raise err from exc
        except BaseException:
            if not job.may_land:
                raise  # withdrawn before it was posted, or nothing of it was
            # Cancelled (a room deadline, the sender closing) once posted: the worker waited for its deadline,
            # and the transfers may still be moving. Say so, with how to learn when they ended: a bare
            # cancellation would leave the sender only write_lifetime. (anyio delivers the cancellation
            # again at the caller's next checkpoint.)
            raise TransportError(f"{what} was cancelled while in flight; NIXL cannot cancel a posted write, so it "
                                 "may still land", may_land=True, settled=_settled(job)) from None


class NixlLink(Link):
    """Writes into one peer agent's announced regions."""

    def __init__(self, local: NixlTransport, agent: str, regions: Sequence[MemoryRegion], state: LinkState) -> None:
        self._local = local
        self._agent = agent
        self._announced = RegionSet(regions)
        self._state = state
        self._closed = False

    @property
    def peer(self) -> str:
        return f"nixl:{self._agent}"

    async def write(self, ops: Sequence[WriteOp]) -> None:
        await self._local._write(self, ops)

    async def aclose(self) -> None:
        if self._closed:
            await anyio.lowlevel.checkpoint()
            return
        self._closed = True
        local = self._local
        local._links.discard(self)
        if local.closed:
            await anyio.lowlevel.checkpoint()
            return
        engine, state = local._engine, self._state
        with anyio.CancelScope(shield=True):
            try:
                await local._worker.call(lambda: engine.close_link(state))
            except Exception as exc:
                raise _native(f"nixl: closing the link to {self.peer}", exc) from exc
