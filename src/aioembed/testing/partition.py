"""A real network partition between an encoder and the language-model process, for any transport.

Three network namespaces joined by veth pairs (root only; skipped elsewhere): sender X behind link A,
sender Y behind link C, and the receiver R in B between them, the links rate-limited (``tc tbf``) so
that writes take seconds. X's link is cut in the middle of its writes and healed some seconds after
the receiver declared X dead. Meanwhile Y keeps sending rooms into the same pool. What must hold:

* X's rooms in flight fail with a clear error (the receiver declares X dead after its heartbeats);
* the blocks X may still write stay fenced: silence proves nothing, and what X's side still holds
  (its kernel's socket buffers, a transport's retries) is delivered once the link heals. Y's rooms,
  which take blocks from the same pool throughout, all arrive bit for bit (had a fenced block been
  handed to Y, X's late bytes could land in a Y room and its check would fail), and X's blocks are
  still fenced when Y is done;
* ``-m slow``: once X's writes are known to be over, the pool comes back whole.

The three processes run on each event loop in ``backends`` (asyncio and uvloop by default).

A plugin runs it by subclassing (compare :class:`~aioembed.testing.TransportConformance`), naming the
options that make an endpoint use a given address::

    from aioembed.testing.partition import PartitionSuite

    class TestPartition(PartitionSuite):
        transport_name = "mine"

        def transport_options(self, ip: str) -> dict[str, Any]:
            return {"host": ip}
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
import pytest

from aioembed.testing.processes import RoomSpec, SideSpec, side_logs, spawn

__all__ = ["Net", "PartitionSuite", "partitionable_net"]

HIDDEN = 1024  # 2092 B a token: a 3000-token room is 6.3 MB, about a second over a 50 Mbit/s link
Y_ROOMS = 24


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def _in(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *args], check=True, capture_output=True, text=True, timeout=10)


@dataclass
class Net:
    """Namespaces ``a`` (X), ``b`` (R) and ``c`` (Y) on one subnet, each linked to the switch ``s``."""

    a: str
    b: str
    c: str
    s: str
    """The switch: a bridge joining the three links, no address."""
    x_ip: str = "10.199.1.1"
    r_ip: str = "10.199.1.2"
    y_ip: str = "10.199.1.3"
    x_dev: str = ""
    r_dev: str = ""
    """R's end of its link (``x_dev`` is X's)."""

    def cut(self) -> None:
        _in(self.a, "ip", "link", "set", self.x_dev, "down")

    def heal(self) -> None:
        _in(self.a, "ip", "link", "set", self.x_dev, "up")


@contextmanager
def partitionable_net() -> Iterator[Net]:
    """Namespaces and links for :class:`PartitionSuite`, removed on exit; ``pytest.skip`` where they cannot be
    made (not root, no ``ip`` or ``tc``, no network namespaces)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("a network partition needs root, `ip` and `tc` (network namespaces and veth pairs)")
    tag = uuid.uuid4().hex[:6]
    n = Net(a=f"aioe-a-{tag}", b=f"aioe-b-{tag}", c=f"aioe-c-{tag}", s=f"aioe-s-{tag}", x_dev=f"xa{tag}",
            r_dev=f"rb{tag}")
    made: list[str] = []
    pairs: list[str] = []  # veth pairs: removed here too, should one have been left in this namespace
    try:
        try:
            for ns in (n.a, n.b, n.c, n.s):
                _ip("netns", "add", ns)
                made.append(ns)
                _in(ns, "ip", "link", "set", "lo", "up")
            # One subnet, switched by a bridge in a fourth namespace that holds no address: each endpoint sees
            # one plain veth device (UCX refuses connections that arrive on a device it did not see at start,
            # such as a bridge, and two routed subnets confused its reachability checks). Both ends of each
            # link are rate-limited; X's end is the one cut.
            bridge = f"br{tag}"
            _in(n.s, "ip", "link", "add", bridge, "type", "bridge")
            _in(n.s, "ip", "link", "set", bridge, "up")
            for dev, port, ns, ip in ((n.x_dev, f"sa{tag}", n.a, n.x_ip), (n.r_dev, f"sb{tag}", n.b, n.r_ip),
                                      (f"yc{tag}", f"sc{tag}", n.c, n.y_ip)):
                pairs.append(dev)
                # Made inside the namespaces: a device appearing in this one would be seen by the UCX of every
                # process here (other tests' included).
                _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", n.s)
                _in(ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
                _in(n.s, "ip", "link", "set", port, "master", bridge)
                for where, d in ((ns, dev), (n.s, port)):
                    _in(where, "ip", "link", "set", d, "up")
                    _in(where, "tc", "qdisc", "add", "dev", d, "root", "tbf", "rate", "50mbit", "burst", "64kb",
                        "latency", "400ms")
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
            pytest.skip(f"cannot build network namespaces here: {detail}")
        yield n
    finally:
        # Whatever ended the set-up or the test (a skip, an `ip` that timed out, a cancellation, an interrupt):
        # deleting a namespace removes its end of each veth pair, and so the pair; a pair not moved yet is
        # deleted here. One removal failing or timing out does not keep the others from running.
        for what in [*(["netns", "delete", ns] for ns in made), *(["link", "delete", dev] for dev in pairs)]:
            with suppress(subprocess.TimeoutExpired, OSError):
                subprocess.run(["ip", *what], capture_output=True, timeout=10, check=False)


class PartitionSuite:
    """Subclass with ``transport_name`` and :meth:`transport_options` to run the partition scenarios."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.anyio]
    transport_name: ClassVar[str]
    fenced_when_y_is_done: ClassVar[bool] = True
    """X's blocks are still fenced when Y's last room arrived, some seconds after the heal: true where X proves
    its writes over only after a long write lifetime (Mooncake: at least 32 s); a transport whose writer
    proves them over within seconds of the heal (its ``DRAINED`` after a short write lifetime) sets False."""
    backends: ClassVar[tuple[str, ...]] = ("asyncio", "uvloop")
    """Event loops the three processes run on (:data:`~aioembed.testing.event_loops.EVENT_LOOPS`): the bounded
    test runs on each, the slow one on the first. The test process itself only orchestrates (on asyncio)."""
    heal_after: ClassVar[float] = 4.0
    """Seconds the link stays down once the receiver declared X dead (past X's own write timeout, so that
    what X's side still holds is all it may still deliver)."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "side_backend" in metafunc.fixturenames:
            slow = metafunc.definition.get_closest_marker("slow") is not None
            metafunc.parametrize("side_backend", self.backends[:1] if slow else self.backends)

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"

    @pytest.fixture
    def net(self) -> Iterator[Net]:
        with partitionable_net() as n:
            yield n

    def transport_options(self, ip: str) -> dict[str, Any]:
        """Options of an endpoint that uses address ``ip`` (its namespace's end of the link): each plugin's
        subclass says (the suite cannot guess a transport's option names)."""
        raise NotImplementedError(f"{type(self).__name__} must define transport_options(ip)")

    def config(self, ip: str, *, pool_tokens: int) -> dict[str, Any]:
        return {
            "transport": self.transport_name, "transport_options": self.transport_options(ip),
            "default_tokens": 1024, "pool_tokens": pool_tokens, "heartbeat_interval": 0.5, "heartbeat_misses": 4,
            "handshake_timeout": 5.0, "input_timeout": 120.0, "round_timeout": 120.0,
        }

    async def _partition(self, net: Net, backend: str, *, settle: float) -> tuple[dict[str, dict[str, Any]],
                                                                                 dict[str, Any]]:
        """X's rooms cut mid-write while Y's go on; the receiver's room events by room, and its done event."""
        x_addr, y_addr = f"tcp://{net.x_ip}:5701", f"tcp://{net.y_ip}:5702"
        x_rooms = [RoomSpec(f"x{i}", 3000) for i in range(4)]
        y_rooms = [RoomSpec(f"y{i}", 1500, sender=y_addr) for i in range(Y_ROOMS)]
        x_spec = SideSpec(role="send", config=self.config(net.x_ip, pool_tokens=8192), rooms=x_rooms,
                          hidden=HIDDEN, bind=x_addr, concurrency=len(x_rooms), linger=3600.0, netns=net.a,
                          backend=backend)
        y_spec = SideSpec(role="send", config=self.config(net.y_ip, pool_tokens=8192), rooms=y_rooms,
                          hidden=HIDDEN, bind=y_addr, concurrency=4, linger=3600.0, netns=net.c,
                          backend=backend)
        # Y's rooms, 4 at a time beside X's, take blocks from the pool all through the cut, the heal and the
        # seconds after it, when X's side delivers what it still held (about 12 s of Y's writes).
        r_spec = SideSpec(role="receive", config=self.config(net.r_ip, pool_tokens=24576), rooms=x_rooms + y_rooms,
                          hidden=HIDDEN, connect=x_addr, concurrency=len(x_rooms) + 4, settle=settle, netns=net.b,
                          backend=backend)
        rooms: dict[str, dict[str, Any]] = {}
        async with spawn(x_spec) as x, spawn(y_spec) as y:
            await x.ready(also=[y])
            await y.ready(also=[x])
            async with spawn(r_spec) as r:
                await r.ready(also=[x, y])
                await anyio.sleep(1.0)  # X's rooms are moving (about 4 s of writes over its link)
                net.cut()
                with anyio.fail_after(30):  # until the receiver declared X dead: one of X's rooms failed
                    while not any(room.startswith("x") and not ev["ok"] for room, ev in rooms.items()):
                        ev = await r.next_event(timeout=30)
                        assert ev["event"] == "room", f"{ev}\n{side_logs(r, x, y)}"
                        rooms[str(ev["room"])] = ev
                await anyio.sleep(self.heal_after)
                net.heal()
                while True:
                    ev = await r.next_event(timeout=settle + 180)
                    if ev["event"] == "done":
                        return rooms, ev
                    if ev["event"] == "room":
                        rooms[str(ev["room"])] = ev

    @staticmethod
    def _check(rooms: dict[str, dict[str, Any]]) -> None:
        ys = [ev for room, ev in rooms.items() if room.startswith("y")]
        assert len(ys) == Y_ROOMS and all(ev["ok"] for ev in ys), [(ev["room"], ev.get("kind"), ev.get("error"))
                                                                 for ev in ys if not ev["ok"]][:3]
        failed = [ev for room, ev in rooms.items() if room.startswith("x") and not ev["ok"]]
        assert failed, "the cut hit none of X's rooms"
        for ev in failed:  # a clear reason, never rows that differ
            assert ev["kind"] in {"PeerDead", "TransferTimeout", "TransferFailed", "TransferAborted"}, ev
            assert "differ" not in (ev.get("error") or ""), ev

    async def test_a_partitioned_encoders_blocks_stay_fenced_while_another_encoder_fills_the_pool(
            self, net: Net, side_backend: str) -> None:
        rooms, done = await self._partition(net, side_backend, settle=0.0)
        self._check(rooms)
        if self.fenced_when_y_is_done:
            # Y is done some seconds after the heal: X cannot have proven its writes over yet (its transport's
            # write lifetime is longer), so what it may still write is fenced.
            assert done["stats"]["fenced"] > 0, done

    @pytest.mark.slow
    async def test_after_a_partition_heals_the_pool_comes_back_whole(self, net: Net, side_backend: str) -> None:
        rooms, done = await self._partition(net, side_backend, settle=120.0)
        self._check(rooms)
        assert done["pool_free"], done
