"""Closing a link lets the engine close its TCP connections to that peer.

The engine's TCP transport keeps up to ``MC_TCP_LANES_PER_PEER`` (default 4) connections open to every peer
and closes one only when a transfer fails on it. A peer that died while they were idle left them in
CLOSE-WAIT for good: a long-lived sender lost four file descriptors per receiver process that was killed and
replaced (the next process has other ports, so nothing ever used those connections again). Closing the link
now queues one-byte *reads* (never a write) that fail on those dead connections, which the engine closes; a peer
that still answers them keeps its connections, and is read from again at each later link close until it does not.

The peer is a real endpoint in another process (``peer_proc.py``); sockets are read from ``/proc``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from aioembed.transports.base import MemoryRegion, WriteOp

from aioembed_mooncake import MooncakeTransport
from aioembed_mooncake.transport import _RELEASE_WAIT

sys.path.insert(0, str(Path(__file__).parent))
from procstate import wait_stopped
from test_peer_gone import _peer_process

pytestmark = pytest.mark.anyio

# Small engine transfers, so that one write keeps several of the engine's lanes busy at once and opens them.
OPTIONS = {"protocol": "tcp", "hostname": "127.0.0.1", "transfer_timeout": 5, "max_batch_bytes": 64 << 10}
SIZE = 1 << 20
_TCP_STATES = {"01": "ESTABLISHED", "08": "CLOSE_WAIT", "0A": "LISTEN"}

needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="reads sockets from /proc")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # engine behaviour, loop-independent


def _socket_inodes(pid: int | str) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _tcp_sockets(pid: int | str = "self") -> list[tuple[int, int, str]]:
    """(local port, remote port, state) of the TCP sockets ``pid`` holds open."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                found.append((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16),
                              _TCP_STATES.get(fields[3], fields[3])))
    return found


def _to(ports: set[int]) -> list[str]:
    """States of this process's sockets connected to one of ``ports``."""
    return sorted(state for _, remote, state in _tcp_sockets() if remote in ports)


@contextmanager
def _owner() -> Iterator[tuple[subprocess.Popen[str], dict[str, Any], set[int]]]:
    """An owner endpoint in its own process: (process, its announcement, the ports it listens on)."""
    with _peer_process(SIZE, OPTIONS) as (proc, info):
        ports = {local for local, _, state in _tcp_sockets(proc.pid) if state == "LISTEN"}
        assert ports, "the owner listens on no TCP port"
        yield proc, info, ports


async def _until(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        await anyio.sleep(0.02)
    return bool(check())


def _sum(proc: subprocess.Popen[str], off: int, n: int) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"sum {off} {n}\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


@needs_proc
async def test_closing_the_link_to_a_killed_idle_peer_closes_its_connections() -> None:
    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    with _owner() as (proc, info, ports):
        async with await MooncakeTransport.open(OPTIONS) as t:
            await t.register([MemoryRegion(src.data_ptr(), SIZE)])
            link = await t.connect(bytes.fromhex(str(info["descriptor"])))
            await _open_lanes(link, WriteOp(src.data_ptr(), int(str(info["addr"])), SIZE), ports)

            proc.kill()  # while idle: no transfer in flight, so none fails and closes a connection
            proc.wait()
            assert await _until(lambda: _to(ports) and set(_to(ports)) == {"CLOSE_WAIT"}, 5), _to(ports)
            stale = len(_to(ports))

            await link.aclose()  # what a sender does once it declared the receiver dead
            closed = await _until(lambda: not _to(ports), 5)
            assert closed, (f"{len(_to(ports))} of the {stale} connections to the killed peer still open after "
                            f"its link closed: {_to(ports)}")


@needs_proc
async def test_closing_the_link_to_a_live_peer_writes_nothing_and_keeps_the_peer_reachable() -> None:
    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    digest = hashlib.sha1(src.numpy().tobytes()).hexdigest()
    with _owner() as (proc, info, _ports):
        async with await MooncakeTransport.open(OPTIONS) as t:
            await t.register([MemoryRegion(src.data_ptr(), SIZE)])
            descriptor = bytes.fromhex(str(info["descriptor"]))
            link = await t.connect(descriptor)
            await link.write([WriteOp(src.data_ptr(), int(str(info["addr"])), SIZE)])
            assert _sum(proc, 0, SIZE) == digest

            from aioembed_mooncake._engine import tcp_lanes_per_peer

            reads: list[Any] = []
            add = t._poller.add

            def seen(transfers: Any) -> None:
                reads.extend(transfers)
                add(transfers)

            t._poller.add = seen  # type: ignore[method-assign]  # the release reads, as they are queued
            await link.aclose()  # waits (a little) for them
            assert len(reads) == tcp_lanes_per_peer()
            assert {r.status for r in reads} == {1}  # they ended, and succeeded: the peer is alive
            assert not t._releases  # seen ending during the close: their engine ids are given back
            assert _sum(proc, 0, SIZE) == digest  # they wrote nothing there

            again = await t.connect(descriptor)
            await again.write([WriteOp(src.data_ptr(), int(str(info["addr"])), SIZE // 2)])
            await again.aclose()


async def _open_lanes(link: Any, op: WriteOp, ports: set[int]) -> None:
    for _ in range(20):  # until the engine opened several lanes (one per transfer it runs at once)
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(link.write, [op])
        if _to(ports).count("ESTABLISHED") >= 2:
            return
    raise AssertionError(f"the engine opened fewer than two lanes: {_to(ports)}")


@needs_proc
async def test_a_peer_that_outlived_its_link_has_its_connections_closed_at_a_later_link_close() -> None:
    """A language-model rank that idled out of this encoder (its link closed while it still answered) and exits
    later: the lanes it kept would stay in CLOSE-WAIT for good. The next link close reads from it again, and those
    reads fail on its dead lanes, which the engine closes; a peer that still answers keeps its lanes."""
    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    async with await MooncakeTransport.open(OPTIONS) as t:
        await t.register([MemoryRegion(src.data_ptr(), SIZE)])
        with _owner() as (first, info, first_ports):
            link = await t.connect(bytes.fromhex(str(info["descriptor"])))
            await _open_lanes(link, WriteOp(src.data_ptr(), int(str(info["addr"])), SIZE), first_ports)
            await link.aclose()  # the peer answers the release reads: its lanes stay open
            assert list(t._lingering) == [link.session]
            assert _to(first_ports).count("ESTABLISHED") >= 2, _to(first_ports)
            first.kill()  # later, while idle
            first.wait()
            assert await _until(lambda: set(_to(first_ports)) == {"CLOSE_WAIT"}, 5), _to(first_ports)
        with _owner() as (_second, info, second_ports):
            other = await t.connect(bytes.fromhex(str(info["descriptor"])))
            await other.write([WriteOp(src.data_ptr(), int(str(info["addr"])), SIZE)])
            await other.aclose()  # reads from the first peer again (they fail), and from this one (they succeed)
            assert await _until(lambda: not _to(first_ports), 5), (
                f"connections to the peer that outlived its link still open after a later link closed: "
                f"{_to(first_ports)}")
            assert "ESTABLISHED" in _to(second_ports)  # a live peer keeps its lanes for a later link
            again = await t.connect(bytes.fromhex(str(info["descriptor"])))
            assert other.session not in t._lingering  # its lanes are a link's again
            await again.aclose()  # the look at this close forgets the first peer, whose reads failed
            assert list(t._lingering) == [other.session]


@needs_proc
async def test_a_lingering_peer_that_froze_neither_holds_later_closes_nor_piles_up_reads() -> None:
    """Reads to a frozen peer end only at the engine's progress timeout: a close waits for its own peer's reads, not
    a lingering one's, and a lingering peer whose last reads have not ended gets no new ones."""
    src = torch.zeros(SIZE, dtype=torch.uint8)
    async with await MooncakeTransport.open(OPTIONS) as t:
        await t.register([MemoryRegion(src.data_ptr(), SIZE)])
        with _owner() as (frozen, finfo, _fports), _owner() as (_live, linfo, _lports):
            first = await t.connect(bytes.fromhex(str(finfo["descriptor"])))
            await first.write([WriteOp(src.data_ptr(), int(str(finfo["addr"])), SIZE)])
            await first.aclose()  # it answers: lingering
            assert list(t._lingering) == [first.session]
            os.kill(frozen.pid, signal.SIGSTOP)
            await anyio.to_thread.run_sync(wait_stopped, frozen.pid)
            pending = []
            for _ in range(4):
                link = await t.connect(bytes.fromhex(str(linfo["descriptor"])))
                await link.write([WriteOp(src.data_ptr(), int(str(linfo["addr"])), SIZE)])
                started = time.monotonic()
                await link.aclose()
                assert time.monotonic() - started < _RELEASE_WAIT / 2, "a close waited for a frozen lingering peer"
                pending.append(sum(1 for r in t._lingering[first.session][1] if r.status == 0))
            from aioembed_mooncake._engine import tcp_lanes_per_peer

            assert max(pending) <= tcp_lanes_per_peer(), pending  # one look's reads at most, not one per close
            os.kill(frozen.pid, signal.SIGCONT)


@needs_proc
async def test_closing_links_to_a_frozen_peer_does_not_wait_for_the_release_reads() -> None:
    """Reads to a stopped peer end only at the engine's progress timeout: the link's ``aclose()`` waits for them
    at most ``_RELEASE_WAIT``, the endpoint's not at all."""
    src = torch.zeros(SIZE, dtype=torch.uint8)
    with _owner() as (proc, info, _ports):
        t = await MooncakeTransport.open(OPTIONS)
        try:
            await t.register([MemoryRegion(src.data_ptr(), SIZE)])
            link = await t.connect(bytes.fromhex(str(info["descriptor"])))
            await link.write([WriteOp(src.data_ptr(), int(str(info["addr"])), SIZE)])
            os.kill(proc.pid, signal.SIGSTOP)
            await anyio.to_thread.run_sync(wait_stopped, proc.pid)
            started = time.monotonic()
            await link.aclose()
            assert t._releases and all(r.status == 0 for r in t._releases)
        finally:
            await t.aclose()
        assert time.monotonic() - started < _RELEASE_WAIT + 2.0


def test_lanes_follow_the_engine_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioembed_mooncake._engine import tcp_lanes_per_peer

    for name in ("MC_TCP_ENABLE_CONNECTION_POOL", "MC_TCP_LANES_PER_PEER", "MC_TCP_MAX_CONNECTIONS_PER_PEER"):
        monkeypatch.delenv(name, raising=False)
    assert tcp_lanes_per_peer("0.3.13.post1") == 4
    assert tcp_lanes_per_peer("0.3.12.post1") == 0  # pooled only on request before 0.3.13
    monkeypatch.setenv("MC_TCP_ENABLE_CONNECTION_POOL", "1")
    assert tcp_lanes_per_peer("0.3.12.post1") == 4
    monkeypatch.setenv("MC_TCP_ENABLE_CONNECTION_POOL", "False")
    assert tcp_lanes_per_peer("0.3.13.post1") == 0
    monkeypatch.delenv("MC_TCP_ENABLE_CONNECTION_POOL")
    monkeypatch.setenv("MC_TCP_MAX_CONNECTIONS_PER_PEER", "2")
    assert tcp_lanes_per_peer("0.3.13.post1") == 2
    monkeypatch.setenv("MC_TCP_LANES_PER_PEER", "16")  # the current name wins
    assert tcp_lanes_per_peer("0.3.13.post1") == 16
    for bad in ("0", "17", "", "x", "+3"):
        monkeypatch.setenv("MC_TCP_LANES_PER_PEER", bad)
        assert tcp_lanes_per_peer("0.3.13.post1") == 4  # the engine's default for a value it rejects
