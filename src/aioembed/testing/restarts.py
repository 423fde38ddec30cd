"""Peer restarts, over and over: what a long-running encoder or language-model process lives through.

One side runs in the test process for the whole test; the other side is a process that is started,
used (every room checked bit for bit), killed with SIGKILL while idle, and started again, ``cycles``
times. Once the long-lived side has seen each death, it must hold no more than after the first
cycle: open file descriptors (a transport that keeps sockets to dead peers runs out of them after
some hundreds of restarts), threads, event-loop tasks, and in its own books no peer, room, source,
write or pool block left over. The peer is killed while idle so that every cycle leaves the same
thing behind (a kill in the middle of a write is the chaos tests' subject).

A plugin runs it by subclassing (compare :class:`~aioembed.testing.TransportConformance`)::

    from aioembed.testing.restarts import PeerRestartSuite

    class TestPeerRestarts(PeerRestartSuite):
        transport_name = "mine"
        transport_options = {"protocol": "tcp"}

Both sides run on each event loop in ``backends`` (asyncio and uvloop by default: the long-lived side in the
test process, where its tasks are counted, so not trio); ``pytest -m slow`` adds a longer run of each test on
the first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import anyio
import pytest

from aioembed.config import TransferConfig
from aioembed.samples import deterministic_request, same_rows, standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender
from aioembed.testing.event_loops import AnyioBackend, anyio_backends, running_loop
from aioembed.testing.ports import fixed_port
from aioembed.testing.processes import ProcessSide, RoomSpec, SideSpec, room_source, spawn

__all__ = ["Holdings", "PeerRestartSuite", "holdings"]


@dataclass(frozen=True)
class Holdings:
    """What this process holds that a leak per peer would make grow."""

    fds: int
    sockets: int
    threads: int
    tasks: int
    books: Mapping[str, int] = field(default_factory=dict)
    """The transport's own records (see :meth:`PeerRestartSuite.transport_books`)."""

    def counts(self) -> dict[str, int]:
        return {"fds": self.fds, "sockets": self.sockets, "threads": self.threads, "tasks": self.tasks,
                **self.books}

    def grew_past(self, before: Holdings, slack: int) -> list[str]:
        """What grew by more than ``slack`` since ``before`` (empty: nothing)."""
        was, now = before.counts(), self.counts()
        return [f"{name}: {was.get(name, 0)} -> {n}" for name, n in now.items() if n > was.get(name, 0) + slack]


_TRANSIENT_THREADS = ("AnyIO worker thread", "asyncio-waitpid")
"""Python threads that come and go on their own (idle worker threads linger for 10 s; a child's waiter ends
with it): not counted, as their number says nothing about what a peer left behind."""


def holdings() -> Holdings:
    """Open file descriptors (sockets among them), threads (less the transient ones) and asyncio tasks of this
    process (Linux)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the directory's own descriptor, closed by now
            continue
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:  # no running asyncio loop
        tasks = 0
    transient = sum(t.name.startswith(_TRANSIENT_THREADS) for t in threading.enumerate())
    return Holdings(fds=len(targets), sockets=sum(t.startswith("socket:") for t in targets),
                    threads=len(os.listdir("/proc/self/task")) - transient, tasks=tasks)


async def _settled_holdings(books: Callable[[], Mapping[str, int]], baseline: Holdings | None = None, *,
                            slack: int = 0, settle: float = 0.0) -> Holdings:
    """The least of a few samples over half a second: what is held, not what is passing through. With a
    ``baseline``, first up to ``settle`` seconds for what grew past it to go (records a plugin lets go of a
    bounded time after a peer's death, such as a transfer to it that its engine ends at a timeout)."""
    def sample() -> Holdings:
        return dataclasses.replace(holdings(), books=dict(books()))

    if baseline is not None:
        with anyio.move_on_after(settle):
            while sample().grew_past(baseline, slack):  # noqa: ASYNC110
                await anyio.sleep(0.1)
    samples = []
    for _ in range(5):
        samples.append(sample())
        await anyio.sleep(0.1)
    least = {name: min(h.counts()[name] for h in samples) for name in samples[0].counts()}
    return Holdings(least.pop("fds"), least.pop("sockets"), least.pop("threads"), least.pop("tasks"), least)


async def _until(what: str, done: Callable[[], bool], timeout: float, side: ProcessSide | None = None) -> None:
    """Wait for ``done()`` (tests only: the long-lived side's books are read, nothing is awaited)."""
    with anyio.move_on_after(timeout):
        while not done():  # noqa: ASYNC110 - the library offers no event for "let go of a dead peer"
            await anyio.sleep(0.05)
    if not done():
        tail = f"\n{side.stderr_tail()}" if side is not None else ""
        raise AssertionError(f"not within {timeout} s: {what}{tail}")


class PeerRestartSuite:
    """Subclass with ``transport_name`` (and options) to run the restart scenarios."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.anyio]
    transport_name: ClassVar[str]
    transport_options: ClassVar[Mapping[str, Any]] = {}
    cycles: ClassVar[int] = 3
    """Peer processes started and killed in the bounded run (the first sets the baseline)."""
    soak_cycles: ClassVar[int] = 12
    """The same with ``-m slow``."""
    hidden: ClassVar[int] = 64
    room_tokens: ClassVar[tuple[int, ...]] = (100, 700, 1500)
    """Each cycle's rooms (1500 resumes once into the 1024-token default)."""
    slack: ClassVar[int] = 1
    """What may differ between cycles (a descriptor or thread the runtime opens on its own)."""
    settle_timeout: ClassVar[float] = 5.0
    """Seconds the long-lived side may take, after a peer's death was seen, to let go of what it held for
    that peer (a plugin whose engine ends a transfer to a dead peer only at a timeout sets that timeout and
    some margin)."""
    start_timeout: ClassVar[float] = 60.0
    """Seconds a peer process may take to start (a GPU host with CUDA takes 5-6 s)."""

    backends: ClassVar[tuple[str, ...]] = ("asyncio", "uvloop")
    """Event loops both sides run on (:data:`~aioembed.testing.event_loops.EVENT_LOOPS`; asyncio-based ones: the
    long-lived side counts its asyncio tasks). The bounded tests run on each, the slow ones on the first."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "restart_loop" in metafunc.fixturenames:
            slow = metafunc.definition.get_closest_marker("slow") is not None
            loops = self.backends[:1] if slow else self.backends
            metafunc.parametrize("restart_loop", anyio_backends(*loops))

    @pytest.fixture
    def anyio_backend(self, restart_loop: AnyioBackend) -> AnyioBackend:
        return restart_loop

    def transport_books(self, transport: Any) -> Mapping[str, int]:
        """The sizes of the plugin's own per-peer records on the long-lived side's endpoint (``transport``: the
        plugin's object), compared like the process's holdings: override to name them."""
        return {}

    def config(self) -> dict[str, Any]:
        return {
            "transport": self.transport_name, "transport_options": dict(self.transport_options),
            "default_tokens": 1024, "pool_tokens": 8192, "heartbeat_interval": 0.5, "heartbeat_misses": 4,
            "handshake_timeout": 10.0, "input_timeout": 60.0, "round_timeout": 60.0,
        }

    def _rooms(self, cycle: int) -> list[RoomSpec]:
        return [RoomSpec(f"c{cycle}r{i}", tokens) for i, tokens in enumerate(self.room_tokens)]

    def _books(self, side: EmbeddingSender | EmbeddingReceiver) -> Mapping[str, int]:
        guarded = side._transport  # the session's view of its endpoint, and behind it the plugin's object
        return {} if guarded is None else self.transport_books(guarded.inner)

    @staticmethod
    def _check(seen: list[Holdings], slack: int) -> None:
        grew = seen[-1].grew_past(seen[0], slack)
        assert not grew, (f"after {len(seen) - 1} more peer restarts the long-lived side holds more: "
                          f"{'; '.join(grew)} (per cycle: {seen})")

    async def _sender_outlives_receivers(self, cycles: int) -> None:
        layout = standard_layout(self.hidden)
        async with EmbeddingSender(layout, TransferConfig.from_mapping(self.config())) as sender:
            seen: list[Holdings] = []
            books = functools.partial(self._books, sender)
            for cycle in range(cycles):
                rooms = self._rooms(cycle)
                spec = SideSpec(role="receive", config=self.config(), rooms=rooms, hidden=self.hidden,
                                connect=sender.address, concurrency=len(rooms), backend=running_loop())
                async with spawn(spec) as side:
                    await side.ready(self.start_timeout)
                    async with anyio.create_task_group() as tg:
                        for r in rooms:
                            tg.start_soon(sender.send, r.room, *room_source(layout, r))
                    got = await side.rooms(len(rooms), timeout=120)
                    assert all(ev["ok"] for ev in got), got
                    side.kill()  # idle: every room is done on both sides
                    await _until("the sender lets go of the dead receiver", lambda: not sender.peers
                                 and not sender.rooms_in_flight and not sender.sources_held
                                 and not sender.writes_in_flight, timeout=30, side=side)
                seen.append(await _settled_holdings(books, seen[0] if seen else None, slack=self.slack,
                                                    settle=self.settle_timeout))
            self._check(seen, self.slack)

    async def _receiver_outlives_senders(self, cycles: int) -> None:
        layout = standard_layout(self.hidden)
        address = f"tcp://127.0.0.1:{fixed_port()}"  # each sender restarts on it, as a deployed encoder does
        async with EmbeddingReceiver(layout, TransferConfig.from_mapping(self.config()), connect=address) as receiver:
            seen: list[Holdings] = []
            books = functools.partial(self._books, receiver)
            for cycle in range(cycles):
                rooms = self._rooms(cycle)
                spec = SideSpec(role="send", config=self.config(), rooms=rooms, hidden=self.hidden, bind=address,
                                concurrency=len(rooms), linger=3600.0, backend=running_loop())
                async with spawn(spec) as side:
                    await side.ready(self.start_timeout)
                    got: dict[str, bool] = {}

                    async def take(r: RoomSpec, got: dict[str, bool] = got) -> None:
                        received = await receiver.receive(r.room)
                        got[str(r.room)] = same_rows(received.tensors,
                                                     deterministic_request(layout, r.tokens, r.room))

                    async with anyio.create_task_group() as tg:
                        for r in rooms:
                            tg.start_soon(take, r)
                    assert all(got.values()) and len(got) == len(rooms), got
                    sent = await side.rooms(len(rooms), timeout=60)
                    assert all(ev["ok"] for ev in sent), sent
                    side.kill()  # idle: every room is done on both sides
                    await _until("the receiver sees the sender gone, its pool whole",
                                 lambda: not receiver.connected and not receiver.rooms_in_flight
                                 and receiver.allocator.stats.free == receiver.allocator.stats.total
                                 and not receiver.allocator.stats.fenced, timeout=30, side=side)
                seen.append(await _settled_holdings(books, seen[0] if seen else None, slack=self.slack,
                                                    settle=self.settle_timeout))
            self._check(seen, self.slack)

    async def test_a_sender_outlives_receivers_killed_one_after_another(self) -> None:
        await self._sender_outlives_receivers(self.cycles)

    async def test_a_receiver_outlives_senders_killed_one_after_another(self) -> None:
        await self._receiver_outlives_senders(self.cycles)

    @pytest.mark.slow
    async def test_a_sender_outlives_many_receiver_restarts(self) -> None:
        await self._sender_outlives_receivers(self.soak_cycles)

    @pytest.mark.slow
    async def test_a_receiver_outlives_many_sender_restarts(self) -> None:
        await self._receiver_outlives_senders(self.soak_cycles)
