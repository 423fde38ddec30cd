"""A native NIXL call raising on an error path: the caller gets the first error, and nothing NIXL still holds
drops off the plugin's books (retried later, or logged by name). Each test injects one failure into a real
endpoint's NIXL agent (or NIXL's handle class), the rest real. Found by a review."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from aioembed.errors import TransportError
from aioembed.testing import region_of
from aioembed.transports.base import MemoryRegion, WriteOp
from aioembed.transports.registry import open_transport

from aioembed_nixl._engine import Engine, LinkState
from aioembed_nixl._native import load_nixl
from aioembed_nixl.transport import NixlTransport

from .conftest import NIXL_OPTIONS

pytestmark = pytest.mark.anyio

SMALL = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def raise_once(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str,
               when: Callable[..., bool] = lambda *args, **kwargs: True) -> None:
    """``owner.name`` raises, as NIXL does, the first time ``when(*args)`` holds; it is the real one otherwise."""
    real = getattr(owner, name)
    fired = False

    def once(*args: Any, **kwargs: Any) -> Any:
        nonlocal fired
        if not fired and when(*args, **kwargs):
            fired = True
            raise RuntimeError(f"NIXL_ERR_BACKEND (injected into {name})")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, once)


def dlist_handle_class() -> Any:
    return load_nixl().api.nixl_prepped_dlist_handle


def record_releases(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every descriptor list handle NIXL released from now on."""
    cls, released = dlist_handle_class(), []
    real = cls.release

    def release(handle: Any) -> None:
        real(handle)
        released.append(handle)

    monkeypatch.setattr(cls, "release", release)
    return released


@asynccontextmanager
async def endpoint() -> AsyncIterator[tuple[NixlTransport, Engine]]:
    t = await open_transport("nixl", NIXL_OPTIONS)
    try:
        inner: NixlTransport = t.inner  # type: ignore[attr-defined]  # the plugin, through the boundary
        yield inner, inner._engine
    finally:
        await t.aclose()


async def nixl_holds(t: NixlTransport, region: MemoryRegion) -> bool:
    """Whether NIXL holds ``region`` registered: a peer could still prepare (and write into) it."""
    engine = t._engine

    def prepare() -> bool:
        try:
            handle = engine.agent.prep_xfer_dlist(engine.name, [(region.address, region.length, 0)], "DRAM",
                                                  backends=[engine.backend])
        except Exception:
            return False
        handle.release()
        return True

    return await t.worker.call(prepare)


@dataclass
class Wired:
    """A writer with a link to an owner in this process, one write done (the owner's list prepared)."""

    owner: NixlTransport
    t: NixlTransport
    engine: Engine
    link: Any
    src: torch.Tensor
    dst: torch.Tensor

    @property
    def state(self) -> LinkState:
        return self.link._state  # type: ignore[no-any-return]

    async def write(self, offset: int = 0, length: int = SMALL) -> None:
        await self.link.write([WriteOp(self.src.data_ptr() + offset, self.dst.data_ptr() + offset, length)])


@asynccontextmanager
async def wired() -> AsyncIterator[Wired]:
    async with endpoint() as (owner, _), endpoint() as (t, engine):
        src = torch.randint(1, 256, (SMALL,), dtype=torch.uint8)
        dst = torch.zeros(SMALL, dtype=torch.uint8)
        await owner.register([region_of(dst)])
        await t.register([region_of(src)])
        w = Wired(owner, t, engine, await t.connect(owner.descriptor()), src, dst)
        await w.write()
        yield w


# -- 1: register ----------------------------------------------------------------------------------------------


async def test_a_registration_whose_follow_up_call_fails_is_not_left_in_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    """``register_memory`` succeeded, then ``get_reg_descs`` raised: the region stayed registered in NIXL (a
    peer could prepare it) with no entry on the plugin's books, so nothing ever deregistered it."""
    async with endpoint() as (t, engine):
        a, b = torch.zeros(SMALL, dtype=torch.uint8), torch.zeros(SMALL, dtype=torch.uint8)
        ra, rb = region_of(a), region_of(b)
        agent, registered = engine.agent, False
        real = agent.register_memory

        def register_memory(*args: Any, **kwargs: Any) -> Any:
            nonlocal registered
            out = real(*args, **kwargs)
            registered = True
            return out

        monkeypatch.setattr(agent, "register_memory", register_memory)
        raise_once(monkeypatch, agent, "get_reg_descs", when=lambda *args, **kwargs: registered)
        with pytest.raises(TransportError, match=r"registering 2 region\(s\).*injected into get_reg_descs"):
            await t.register([ra, rb])
        monkeypatch.undo()
        assert not await nixl_holds(t, ra), "a failed register() left the region registered in NIXL"
        assert not await nixl_holds(t, rb)
        assert not engine._regs and not engine._stale and not len(t.regions)
        await t.register([ra])
        await t.unregister([ra])
        assert not await nixl_holds(t, ra)


async def test_a_refused_rollback_of_a_registration_keeps_it_and_reports_the_first_error(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The second region's registration failed and deregistering the first (the rollback) failed too: the
    caller got the rollback's error, and the first region stayed in NIXL, off the books."""
    async with endpoint() as (t, engine):
        a, b = torch.zeros(SMALL, dtype=torch.uint8), torch.zeros(SMALL, dtype=torch.uint8)
        ra, rb = region_of(a), region_of(b)
        calls = 0

        def second(*args: Any, **kwargs: Any) -> bool:
            nonlocal calls
            calls += 1
            return calls == 2

        raise_once(monkeypatch, engine.agent, "register_memory", when=second)
        raise_once(monkeypatch, engine.agent, "deregister_memory")
        with caplog.at_level(logging.WARNING, "aioembed.transports.nixl"), \
                pytest.raises(TransportError, match="injected into register_memory"):
            await t.register([ra, rb])
        monkeypatch.undo()
        assert await nixl_holds(t, ra) and not await nixl_holds(t, rb)  # NIXL refused to let go of ra
        assert [r for r, _ in engine._stale] == [ra] and not engine._regs  # on the books, as NIXL holds it
        assert str(ra) in caplog.text and "retried" in caplog.text
        await t.register([rb])
        await t.unregister([rb])  # the next deregistration retries it
        assert not await nixl_holds(t, ra) and not engine._stale


# -- 2: a prepared list replaced -----------------------------------------------------------------------------


async def test_a_new_prepared_list_is_kept_when_releasing_the_old_one_fails(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A finer write prepares the peer's list again; releasing the old list raised: the write failed with
    the release's error and the new list was lost (left to the garbage collector, holding the agent)."""
    async with wired() as w:
        old = w.state.prepared["DRAM"]
        stale = old.handle
        released = record_releases(monkeypatch)
        raise_once(monkeypatch, dlist_handle_class(), "release", when=lambda h: h is stale)
        with caplog.at_level(logging.WARNING, "aioembed.transports.nixl"):
            await w.write(4096, 4096)  # a finer granule: the list is prepared again
        fresh = w.state.prepared["DRAM"]
        assert fresh is not old and fresh.version == 1 and fresh.handle is not None
        assert [h for _, h in w.engine._unreleased] == [stale]  # kept for a retry, named in the warning
        assert f"could not release a prepared list of agent {w.link._agent}'s memory" in caplog.text
        w.dst.zero_()
        await w.write()  # the new list serves
        assert torch.equal(w.dst, w.src)
        await w.link.aclose()  # a link's close retries it
        assert stale in released and fresh.handle is None and not w.engine._unreleased


# -- 3: a write that fails before posting --------------------------------------------------------------------


async def test_a_write_failing_to_build_reports_its_own_error_and_releases_both_lists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``make_prepped_xfer`` raised, then releasing the write's local list raised too: the caller got the
    release's error, and the write's own remote list was never released."""
    async with wired() as w:
        w.state.lists["DRAM"][0].max_write_descs = 0  # every write with lists of its own (both released here)
        made: list[Any] = []
        real_prep = w.engine.agent.prep_xfer_dlist

        def prep_xfer_dlist(*args: Any, **kwargs: Any) -> Any:
            made.append(real_prep(*args, **kwargs))
            return made[-1]

        monkeypatch.setattr(w.engine.agent, "prep_xfer_dlist", prep_xfer_dlist)
        released = record_releases(monkeypatch)
        raise_once(monkeypatch, w.engine.agent, "make_prepped_xfer")
        raise_once(monkeypatch, dlist_handle_class(), "release")
        with pytest.raises(TransportError, match=f"to {w.link.peer}.*injected into make_prepped_xfer") as info:
            await w.write(0, 4096)
        assert info.value.may_land is False
        own_remote, local = made  # prepared in this order; local released first, and that failed
        assert own_remote in released, "the write's own remote list was never released"
        assert [h for _, h in w.engine._unreleased] == [local]
        await w.link.aclose()
        assert local in released and not w.engine._unreleased


# -- 4: closing a link ---------------------------------------------------------------------------------------


async def test_a_link_whose_list_release_fails_still_lets_its_peer_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Releasing the link's prepared list raised: the peer's link count stayed up, so its metadata stayed
    loaded (and NIXL's connection to it) for as long as the agent lived."""
    async with wired() as w:
        agent, peer = w.engine.agent, w.link._agent
        handle = w.state.prepared["DRAM"].handle
        released = record_releases(monkeypatch)
        raise_once(monkeypatch, dlist_handle_class(), "release")
        with pytest.raises(TransportError, match=f"closing the link to {w.link.peer}.*injected into release"):
            await w.link.aclose()
        assert not agent.check_remote_metadata(peer), "the closed link's peer stayed loaded"
        assert not w.engine._peers and not w.engine._links
        assert [h for _, h in w.engine._unreleased] == [handle]  # kept for a retry
        again = await w.t.connect(w.owner.descriptor())
        await again.aclose()  # the next link's close retries it
        assert handle in released and not w.engine._unreleased


async def test_a_refused_metadata_removal_keeps_the_peer_on_the_books(monkeypatch: pytest.MonkeyPatch) -> None:
    """``remove_remote_agent`` raised: the peer had already left the books while NIXL kept its metadata, and
    nothing removed it again."""
    async with wired() as w:
        agent, peer = w.engine.agent, w.link._agent
        raise_once(monkeypatch, agent, "remove_remote_agent")
        with pytest.raises(TransportError, match=f"closing the link to {w.link.peer}.*injected"):
            await w.link.aclose()
        assert agent.check_remote_metadata(peer) and peer in w.engine._peers, "the books lost a loaded peer"
        w.link = await w.t.connect(w.owner.descriptor())
        w.dst.zero_()
        await w.write()
        assert torch.equal(w.dst, w.src)
        await w.link.aclose()  # removed once the peer is unused again
        assert not agent.check_remote_metadata(peer) and not w.engine._peers


# -- 5: deregistration ---------------------------------------------------------------------------------------


async def test_a_refused_deregistration_stays_on_the_books_and_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """``deregister_memory`` raised: the plugin forgot a registration NIXL still held (NIXL counts them), so
    registering the region again and unregistering it left it registered for as long as the agent lived."""
    async with endpoint() as (t, engine):
        buf = torch.zeros(SMALL, dtype=torch.uint8)
        r = region_of(buf)
        await t.register([r])
        raise_once(monkeypatch, engine.agent, "deregister_memory")
        with pytest.raises(TransportError, match=r"deregistering 1 region\(s\).*injected into deregister_memory"):
            await t.unregister([r])
        assert not len(t.regions)  # the caller's unregister took effect on the plugin's side
        assert await nixl_holds(t, r)
        await t.register([r])
        await t.unregister([r])  # retries the refused one too
        assert not await nixl_holds(t, r), "a refused deregistration left the region registered in NIXL"
        assert not engine._regs and not engine._stale


async def test_a_refused_deregistration_is_retried_at_aclose(monkeypatch: pytest.MonkeyPatch) -> None:
    deregistered: list[Any] = []
    async with endpoint() as (t, engine):
        buf = torch.zeros(SMALL, dtype=torch.uint8)
        r = region_of(buf)
        await t.register([r])
        reg = engine._regs[r]
        real = engine.agent.deregister_memory

        def deregister_memory(dlist: Any, **kwargs: Any) -> None:
            real(dlist, **kwargs)
            deregistered.append(dlist)

        monkeypatch.setattr(engine.agent, "deregister_memory", deregister_memory)
        raise_once(monkeypatch, engine.agent, "deregister_memory")
        with pytest.raises(TransportError, match="injected"):
            await t.unregister([r])
        assert not deregistered
    assert deregistered == [reg], "aclose() left a refused deregistration to the agent's destruction"
