"""The NIXL state of one endpoint: its agent, registrations, peers and prepared lists.

Every method runs on the endpoint's worker thread (:mod:`aioembed_nixl._worker`), so none of this is
shared with the event loop and none of it needs a lock. Errors are NIXL's own exceptions; the
transport maps them to ``TransportError`` with the agent and peer named.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
from aioembed.transports.base import MemoryRegion

from aioembed_nixl._descriptor import PeerDescriptor
from aioembed_nixl._dlists import GranuleList, Piece, SegmentIndex, cut_pieces, device_id, mem_type
from aioembed_nixl._native import Nixl, create_agent
from aioembed_nixl._options import NixlOptions
from aioembed_nixl._worker import AgentWorker, Posted, WriteJob

__all__ = ["Engine", "LinkState"]

log = logging.getLogger("aioembed.transports.nixl")

_LOCAL = "NIXL_INIT_AGENT"


class _Prepared:
    """A prepared remote list, and how many posted transfers still use it."""

    __slots__ = ("handle", "retired", "users", "version")

    def __init__(self, handle: Any, version: int) -> None:
        self.handle = handle
        self.version = version
        self.users = 0
        self.retired = False

    def take_if_unused(self) -> Any:
        """The handle, taken for the caller to release, once retired and unused; else None."""
        if self.retired and self.users == 0 and self.handle is not None:
            handle, self.handle = self.handle, None
            return handle
        return None


def _prepared_list(peer: str) -> str:
    """How a prepared list is named in warnings and teardown problems."""
    return f"a prepared list of agent {peer}'s memory"


class _Peer:
    """A remote agent whose metadata this agent holds, with its links and transfers."""

    __slots__ = ("inflight", "links", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.links = 0
        self.inflight = 0


class LinkState:
    """Thread-side state of one link: the peer's segments and its prepared list per memory type."""

    def __init__(self, peer: _Peer, regions: Sequence[MemoryRegion]) -> None:
        self.peer = peer
        self.segments = SegmentIndex(regions)
        self.closed = False
        self.lists: dict[str, tuple[GranuleList, dict[int, int]]] = {}
        by_type: dict[str, list[int]] = {}
        for i, s in enumerate(self.segments.segments):
            by_type.setdefault(mem_type(s.device), []).append(i)
        for mem, idx in by_type.items():
            self.lists[mem] = (GranuleList([self.segments.segments[i] for i in idx]), {g: k for k, g in enumerate(idx)})
        self.prepared: dict[str, _Prepared] = {}


class _Resources:
    """What one posted transfer holds until it has ended."""

    __slots__ = ("engine", "local", "own_remote", "peer", "prepared", "xfer")

    def __init__(self, engine: Engine, peer: _Peer, xfer: Any, *, local: Any, own_remote: Any,
                 prepared: _Prepared | None) -> None:
        self.engine = engine
        self.peer = peer
        self.xfer = xfer
        self.local = local
        self.own_remote = own_remote
        self.prepared = prepared

    def release(self, posted: Posted, ended: bool) -> None:
        """Free the transfer's handle and lists. The counts (the prepared list's users, the peer's transfers in
        flight) go down whatever NIXL raises: a release that failed must not keep the peer's metadata, or a
        retired prepared list, for as long as the agent lives."""
        xfer, self.xfer = self.xfer, None
        posted.handle = None
        if xfer is not None:
            try:
                xfer.release()  # for a transfer still in flight NIXL *tries* to cancel it (see README)
            except Exception as exc:
                log.warning("nixl: could not release a transfer handle (%s: %s); left to the agent's teardown",
                            type(exc).__name__, exc)
                xfer._released = True  # never again from __del__: the agent may be gone by then
        for name in ("local", "own_remote"):
            handle = getattr(self, name)
            setattr(self, name, None)
            if handle is not None:
                self.engine.release_or_warn(handle, f"a transfer's {name} descriptor list")
        prepared, self.prepared = self.prepared, None
        if prepared is not None:
            prepared.users -= 1
            self.engine.retire_or_warn(prepared, self.peer.name)
        self.peer.inflight -= 1
        self.engine.forget_or_warn(self.peer)


class Engine:
    """NIXL agent of one endpoint (see the module docstring)."""

    def __init__(self, nixl: Nixl, name: str, options: NixlOptions) -> None:
        self.name = name
        self.backend = options.backend
        self._backends = [options.backend]
        self.agent: Any = create_agent(nixl, name, options)
        self.mem_types = [str(m) for m in self.agent.get_backend_mem_types(options.backend)]
        self._regs: dict[MemoryRegion, Any] = {}
        self._stale: list[tuple[MemoryRegion, Any]] = []
        """Registrations NIXL refused to deregister: off the books of live memory, still NIXL's (it counts
        registrations of one region), retried at each :meth:`deregister` and at teardown."""
        self._unreleased: list[tuple[str, Any]] = []
        """Descriptor list handles whose release NIXL refused, with what they were: retried when a link
        closes and at teardown."""
        self._local: SegmentIndex | None = None
        self._peers: dict[str, _Peer] = {}
        self._links: list[LinkState] = []

    # -- memory ---------------------------------------------------------------------------

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register distinct new regions (each on its own, so each can be deregistered on its own). Nothing
        that can raise runs between NIXL's registering a region and its entry here: the descriptor list is
        built first, and ``register_memory`` takes it as is. A failure deregisters the regions this call
        registered; the caller gets the failure, not a failed rollback (kept, see :meth:`_deregister_quietly`)."""
        done: list[MemoryRegion] = []
        try:
            for r in regions:
                reg = self.agent.get_reg_descs([(r.address, r.length, device_id(r.device), "")], mem_type(r.device))
                self.agent.register_memory(reg, backends=self._backends)
                self._regs[r] = reg
                done.append(r)
        except BaseException:
            self._deregister_quietly(done)
            raise
        finally:
            self._local = None

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        """Deregister ``regions``, and retry the registrations NIXL refused before. One NIXL refuses now leaves
        the books of live memory (the caller unregistered it) but not NIXL's: it is kept, retried, and raised."""
        self._local = None
        self._retry_stale()
        failed = self._deregister(regions)
        if failed:
            raise RuntimeError(f"deregister_memory failed for {len(failed)} region(s): {'; '.join(failed[:3])}; "
                               "kept registered in NIXL, retried at the next deregistration and at teardown")

    def _deregister(self, regions: Sequence[MemoryRegion]) -> list[str]:
        """Deregister each of ``regions``; one NIXL refuses goes to :attr:`_stale`. The failures, described."""
        taken = [(r, reg) for r in regions if (reg := self._regs.pop(r, None)) is not None]
        return self._deregister_each(taken, "")

    def _deregister_each(self, pairs: Sequence[tuple[MemoryRegion, Any]], note: str) -> list[str]:
        """``deregister_memory`` for each (region, registration); those NIXL refuses go to :attr:`_stale`."""
        failed: list[str] = []
        for r, reg in pairs:
            try:
                self.agent.deregister_memory(reg, backends=self._backends)
            except Exception as exc:
                self._stale.append((r, reg))
                failed.append(f"{r}{note}: {type(exc).__name__}: {exc}")
        return failed

    def _deregister_quietly(self, regions: Sequence[MemoryRegion]) -> None:
        """Undo a failed registration call: a failure here is logged (and kept), the caller's error is raised."""
        failed = self._deregister(regions)
        if failed:
            log.warning("nixl agent %s: could not deregister %s after a failed registration; kept registered in "
                        "NIXL, retried at the next deregistration and at teardown", self.name, "; ".join(failed))

    def _retry_stale(self) -> list[str]:
        """Deregister again what NIXL refused before; what it refuses again stays. The failures, described."""
        stale, self._stale = self._stale, []
        return self._deregister_each(stale, " (refused before)")

    def local_segments(self) -> SegmentIndex:
        if self._local is None:
            self._local = SegmentIndex(self._regs)
        return self._local

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    # -- peers ----------------------------------------------------------------------------

    def connect(self, desc: PeerDescriptor) -> LinkState:
        """Load the peer's metadata (a second link to the same agent reloads it: NIXL merges), check
        that it is the agent the descriptor names, and open its connection now rather than at the
        first write."""
        if desc.agent == self.name:
            # Loopback: NIXL prepares remote lists under the agent's own name. Only for our own descriptor:
            # our name is public (it is our writer id), and a peer naming it would make us write into our
            # own memory, checked against our own registrations.
            if desc.metadata != self.metadata():
                raise ValueError(f"the descriptor names this agent ({self.name!r}) but carries another agent's "
                                 "metadata")
            name = self.name
        else:
            loaded = self.agent.add_remote_agent(desc.metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        try:
            if name != desc.agent:
                raise ValueError(f"the descriptor names agent {desc.agent!r} but its metadata is agent {name!r}")
            if name != self.name:
                self.agent.make_connection(name, backends=self._backends)
            peer = self._peers.get(name) or _Peer(name)
            link = LinkState(peer, desc.regions)
        except BaseException:
            # What this call loaded goes with it (it was left loaded for as long as the agent lived, once per
            # failed connect); never a live peer's metadata (another link's, whatever the descriptor named).
            if name != self.name and name not in self._peers:
                self._unload(name)
            raise
        self._peers[name] = peer
        peer.links += 1
        self._links.append(link)
        return link

    def _unload(self, name: str) -> None:
        """Remove metadata that no peer record holds, on a failure path: a failure here is logged, not raised
        (the caller's error is the one to report)."""
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:
            log.warning("nixl agent %s: could not remove agent %s's metadata after a failed connect (%s: %s); "
                        "left to the agent's teardown", self.name, name, type(exc).__name__, exc)

    def close_link(self, link: LinkState) -> None:
        """Close a link whatever NIXL raises on the way: each prepared list is released (one NIXL refuses is
        kept for a retry), the peer's count goes down and its metadata goes once unused; then the first
        failure is raised."""
        if link.closed:
            return
        link.closed = True
        self._links.remove(link)
        self._retry_unreleased()  # what NIXL refused before (this link's refusals wait for the next one)
        errors: list[Exception] = []
        for prepared in link.prepared.values():
            prepared.retired = True
            if (exc := self._retire(prepared, link.peer.name)) is not None:
                errors.append(exc)
        link.prepared.clear()
        link.peer.links -= 1
        try:
            self.forget_if_unused(link.peer)
        except Exception as exc:
            errors.append(exc)
        if errors:
            raise errors[0]

    def forget_if_unused(self, peer: _Peer) -> None:
        """Drop a peer's metadata once no link and no transfer uses it (doing it earlier would orphan the
        transfers: ``check_xfer_state`` then raises NOT_FOUND while their bytes still land). Raises NIXL's
        error if it refuses: the peer then stays on the books, as its metadata stays loaded, and its removal
        is retried when it is next unused and at teardown."""
        if peer.links > 0 or peer.inflight > 0 or self._peers.get(peer.name) is not peer:
            return
        if peer.name != self.name and self.agent is not None:
            self.agent.remove_remote_agent(peer.name)
        del self._peers[peer.name]

    def forget_or_warn(self, peer: _Peer) -> None:
        """:meth:`forget_if_unused` where nobody is there to be told (a transfer's end)."""
        try:
            self.forget_if_unused(peer)
        except Exception as exc:
            log.warning("nixl agent %s: could not remove agent %s's metadata (%s: %s); retried when the peer is "
                        "next unused and at teardown", self.name, peer.name, type(exc).__name__, exc)

    # -- descriptor list handles ----------------------------------------------------------

    def _release(self, handle: Any, what: str) -> Exception | None:
        """Release a descriptor list handle; one NIXL refuses is kept in :attr:`_unreleased` (never dropped: its
        wrapper would retry from ``__del__``, on whatever thread, holding the native agent until then)."""
        try:
            handle.release()
        except Exception as exc:
            self._unreleased.append((what, handle))
            return exc
        return None

    def release_or_warn(self, handle: Any, what: str) -> None:
        """:meth:`_release` where the caller's error, or none, is the one to report."""
        if (exc := self._release(handle, what)) is not None:
            log.warning("nixl agent %s: could not release %s (%s: %s); retried when a link closes and at teardown",
                        self.name, what, type(exc).__name__, exc)

    def _retire(self, prepared: _Prepared, peer: str) -> Exception | None:
        """Release a retired prepared list once no transfer uses it."""
        handle = prepared.take_if_unused()
        return None if handle is None else self._release(handle, _prepared_list(peer))

    def retire_or_warn(self, prepared: _Prepared, peer: str) -> None:
        handle = prepared.take_if_unused()
        if handle is not None:
            self.release_or_warn(handle, _prepared_list(peer))

    def _retry_unreleased(self) -> list[str]:
        """Release again what NIXL refused before; what it refuses again stays. The failures, described."""
        unreleased, self._unreleased = self._unreleased, []
        failed: list[str] = []
        for what, handle in unreleased:
            if (exc := self._release(handle, what)) is not None:
                failed.append(f"{what}: {type(exc).__name__}: {exc}")
        return failed

    # -- writes ---------------------------------------------------------------------------

    def post_write(self, job: WriteJob, link: LinkState, ops: Sequence[tuple[int, int, int]]) -> None:
        """Build and post the transfers of one write (one per pair of memory types, usually one)."""
        if link.closed:
            raise RuntimeError("the link was closed")
        local = self.local_segments()
        pieces = cut_pieces(ops, local, link.segments)
        groups: dict[tuple[str, str], list[Piece]] = {}
        for p in pieces:
            key = (mem_type(local.segments[p.local].device), mem_type(link.segments.segments[p.remote].device))
            groups.setdefault(key, []).append(p)
        for (lmem, rmem), group in groups.items():
            self._post(job, link, group, mems=(lmem, rmem), local=local)

    def _prepared(self, link: LinkState, rmem: str, glist: GranuleList) -> _Prepared:
        current = link.prepared.get(rmem)
        if current is not None and current.version == glist.version:
            return current
        handle = self.agent.prep_xfer_dlist(link.peer.name, glist.descriptors(), rmem, backends=self._backends)
        fresh = _Prepared(handle, glist.version)
        link.prepared[rmem] = fresh  # first: the old list's release raising must not lose the new one
        if current is not None:
            current.retired = True
            self.retire_or_warn(current, link.peer.name)
        return fresh

    def _post(self, job: WriteJob, link: LinkState, group: list[Piece], *, mems: tuple[str, str],
              local: SegmentIndex) -> None:
        lmem, rmem = mems
        glist, index = link.lists[rmem]
        plan = glist.plan([p._replace(remote=index[p.remote]) for p in group], local)
        prepared: _Prepared | None = None
        own_remote: Any = None
        local_list: Any = None
        try:
            if plan.remote_indices is not None:
                prepared = self._prepared(link, rmem, glist)
                remote, indices = prepared.handle, plan.remote_indices
            else:
                assert plan.remote is not None
                own_remote = self.agent.prep_xfer_dlist(link.peer.name, plan.remote, rmem, backends=self._backends)
                remote, indices = own_remote, np.arange(len(plan.remote), dtype=np.int32)
            local_list = self.agent.prep_xfer_dlist(_LOCAL, plan.local, lmem, backends=self._backends)
            xfer = self.agent.make_prepped_xfer("WRITE", local_list, np.arange(len(plan.local), dtype=np.int32),
                                                remote, indices, backends=self._backends)
        except BaseException:
            for name, handle in (("local", local_list), ("own_remote", own_remote)):
                if handle is not None:  # each released whatever the other does; the caller gets the first error
                    self.release_or_warn(handle, f"a write's {name} descriptor list")
            raise
        res = _Resources(self, link.peer, xfer, local=local_list, own_remote=own_remote, prepared=prepared)
        if prepared is not None:
            prepared.users += 1
        link.peer.inflight += 1
        # Not ``self.agent.check_xfer_state``: a bound method of the wrapper would keep the native agent alive
        # (and its transfers moving) for as long as anyone holds the Posted, e.g. a failed write's ``settled``.
        posted = Posted(xfer, plan.nbytes, self._check, res.release)
        try:
            state = self.agent.transfer(xfer)
        except BaseException:
            # NIXL raises for errors met while posting too (a disconnect after some puts left): what was
            # posted before the error may move on, and its end cannot be watched any more.
            job.uncertain = True
            posted.ended = True
            res.release(posted, True)
            raise
        job.posted.append(posted)
        if state != "PROC":
            posted.ended = True
            res.release(posted, True)
            if state != "DONE":
                raise RuntimeError(f"transfer() returned {state!r}")

    def _check(self, handle: Any) -> str:
        if self.agent is None:
            raise RuntimeError("the agent was destroyed")
        return str(self.agent.check_xfer_state(handle))

    # -- teardown -------------------------------------------------------------------------

    def teardown(self, worker: AgentWorker) -> None:
        """Release everything and destroy the agent (on this thread: its destructor joins NIXL's progress
        thread). Destroying the agent is also the only way to stop transfers still in flight."""
        problems: list[str] = []

        def attempt(what: str, fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:
                problems.append(f"{what}: {type(exc).__name__}: {exc}")

        drained = worker.drain_inflight("the endpoint closed")
        try:
            for posted in [p for job in drained for p in job.pending]:
                attempt("releasing a transfer in flight", posted.release, posted, False)
            for link in list(self._links):
                attempt("closing a link", self.close_link, link)
            problems.extend(f"releasing {what} (refused before)" for what in self._retry_unreleased())
            for _, handle in self._unreleased:
                handle._released = True  # never again from __del__: the agent is destroyed below
            self._unreleased.clear()
            problems.extend(f"deregistering {r}" for r in self._retry_stale())
            problems.extend(f"deregistering {r}" for r in self._deregister(list(self._regs)))
            self._stale.clear()  # what NIXL still refuses goes with the agent
            for peer in list(self._peers.values()):
                del self._peers[peer.name]
                if peer.name != self.name:
                    attempt(f"forgetting agent {peer.name}", self.agent.remove_remote_agent, peer.name)
            agent, self.agent = self.agent, None
            del agent  # the last reference: the native agent is destroyed here
        finally:
            for job in drained:
                worker.settle(job)  # only now does nothing of them move any more
        if problems:
            log.warning("nixl agent %s: teardown: %s", self.name, "; ".join(problems))
