"""What the kernel adds to the heartbeats on the control sockets (see :mod:`aioembed.control.sockets`).

* The sender's ROUTER drops a half-open connection (a receiver's host gone without a FIN) about twice the silence
  window after that host last acknowledged anything, whether the connection was idle (keepalive) or held
  unacknowledged frames (the retransmit timeout). With Linux's defaults it stayed 2 h 11 min, or about 15 min.
* The receiver's DEALER gives a connect up after a second and connects again, so a sender host back at an address
  that dropped packets is reached within seconds, not at the kernel's next SYN retransmit (1, 3, 7, 15, 31, 63 s).

The real checks run the two sockets in network namespaces joined by veth pairs (the partition suite's
:func:`~aioembed.testing.partition.partitionable_net`: root, ``ip`` and ``tc``; skipped elsewhere) and cut one
side's link, with its neighbour entry pinned on the other side so that packets vanish (a neighbour lookup that fails
makes the kernel refuse at once, which is not the case under test).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
import zmq

from aioembed import TransferConfig
from aioembed.control.sockets import make_dealer, make_router
from aioembed.testing.partition import Net, partitionable_net

_SIDE = r"""
import sys, zmq
from zmq.utils.monitor import parse_monitor_message
from aioembed import TransferConfig
from aioembed.control.sockets import make_dealer, make_router

role, address, interval, misses = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
cfg = TransferConfig(heartbeat_interval=interval, heartbeat_misses=misses)
ctx = zmq.Context()
if role == "router":
    sock, _, _ = make_router(ctx, address, cfg)
    print("bound", flush=True)
else:
    sock = make_dealer(ctx, address, cfg)
    sock.send(b"hello")
    print("connecting", flush=True)
mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
poller = zmq.Poller()
poller.register(sock, zmq.POLLIN)
poller.register(mon, zmq.POLLIN)
poller.register(sys.stdin.fileno(), zmq.POLLIN)
peer = None
while True:
    ready = dict(poller.poll())
    if sock in ready:
        frames = sock.recv_multipart()
        peer = frames[0]
        print("got", flush=True)
    if mon in ready:
        if parse_monitor_message(mon.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED:
            print("disconnected", flush=True)
    if sys.stdin.fileno() in ready:
        line = sys.stdin.readline()
        if not line:
            break
        sock.send_multipart([peer, b"x" * 1000])  # a frame its peer never acknowledges
        print("sent", flush=True)
"""


class _Side:
    """One control socket in a process of its own inside network namespace ``ns``; its lines come with the time
    they were read."""

    def __init__(self, ns: str, role: str, address: str, cfg: TransferConfig) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", _SIDE, role, address, str(cfg.heartbeat_interval),
             str(cfg.heartbeat_misses)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, text=True)

    def expect(self, line: str, timeout: float) -> float:
        """When ``line`` came (``time.monotonic()``); fails after ``timeout`` seconds or on another line."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            readable, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not readable:
                raise AssertionError(f"no {line!r} within {timeout} s")
            got = self.proc.stdout.readline().strip()
            at = time.monotonic()
            if not got:
                raise AssertionError(f"exited before {line!r}: {self.proc.stderr.read() if self.proc.stderr else ''}")
            assert got == line, f"expected {line!r}, got {got!r}"
            return at

    def say(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("send\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=10)


def _ip_in(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "ip", *args], check=True, capture_output=True, text=True, timeout=10)


def _pin_neighbour(net: Net, *, ns: str, dev: str, ip: str, peer_ns: str, peer_dev: str) -> None:
    """``ns`` keeps sending to ``ip`` while its link is cut (no failed neighbour lookup refusing at once)."""
    mac = subprocess.run(["ip", "netns", "exec", peer_ns, "cat", f"/sys/class/net/{peer_dev}/address"], check=True,
                         capture_output=True, text=True, timeout=10).stdout.strip()
    _ip_in(ns, "neigh", "replace", ip, "lladdr", mac, "dev", dev, "nud", "permanent")


@contextmanager
def _sides() -> Iterator[tuple[Net, ExitStack]]:
    with partitionable_net() as net, ExitStack() as stack:
        _pin_neighbour(net, ns=net.b, dev=net.r_dev, ip=net.x_ip, peer_ns=net.a, peer_dev=net.x_dev)
        _pin_neighbour(net, ns=net.a, dev=net.x_dev, ip=net.r_ip, peer_ns=net.b, peer_dev=net.r_dev)
        yield net, stack


def _side(stack: ExitStack, ns: str, role: str, address: str, cfg: TransferConfig) -> _Side:
    side = _Side(ns, role, address, cfg)
    stack.callback(side.close)
    return side


def test_the_control_sockets_carry_keepalive_and_timeouts_that_fit_the_heartbeats() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for cfg, idle, interval, count, maxrt, connect in (
            (TransferConfig(), 5, 1, 5, 10_000, 1000),  # silence window 5 s: dropped ~10 s after the last ack
            (TransferConfig(heartbeat_interval=0.05, heartbeat_misses=3), 1, 1, 3, 2000, 1000),
            (TransferConfig(heartbeat_interval=4.0, heartbeat_misses=10), 40, 4, 10, 80_000, 4000),
            (TransferConfig(heartbeat_interval=86400.0, heartbeat_misses=1000), 32767, 32767, 127, (1 << 31) - 1,
             86_400_000),  # the kernel's limits
        ):
            router, _, _ = make_router(ctx, "tcp://127.0.0.1:0", cfg)
            dealer = make_dealer(ctx, "tcp://127.0.0.1:1", cfg)
            try:
                assert router.getsockopt(zmq.TCP_KEEPALIVE) == 1
                assert (router.getsockopt(zmq.TCP_KEEPALIVE_IDLE), router.getsockopt(zmq.TCP_KEEPALIVE_INTVL),
                        router.getsockopt(zmq.TCP_KEEPALIVE_CNT), router.getsockopt(zmq.TCP_MAXRT)) == (
                            idle, interval, count, maxrt), cfg
                assert dealer.getsockopt(zmq.CONNECT_TIMEOUT) == connect, cfg
                # The receiver finds a half-open connection itself (and a drop from its own kernel in a live session
                # would read as the sender closing it): its keepalive keeps the kernel's timing.
                assert dealer.getsockopt(zmq.TCP_KEEPALIVE) == 1
                assert (dealer.getsockopt(zmq.TCP_KEEPALIVE_IDLE), dealer.getsockopt(zmq.TCP_MAXRT)) == (-1, 0)
            finally:
                router.close(linger=0)
                dealer.close(linger=0)
    finally:
        ctx.term()


@pytest.mark.parametrize("unacknowledged", [False, True], ids=["idle", "unacknowledged"])
def test_the_sender_drops_the_connection_of_a_receiver_host_gone_without_a_fin(unacknowledged: bool) -> None:
    """The receiver's host vanishes (its link cut: no FIN, nothing answers). The sender's session ends after the
    silence window (1 s here); the connection, ZeroMQ's pipe and what is queued on it go about a second later.
    Before, an idle one stayed 2 h 11 min (Linux's keepalive defaults), one holding a frame the receiver never
    acknowledged about 15 min (the kernel's retransmits)."""
    cfg = TransferConfig(heartbeat_interval=0.5, heartbeat_misses=2)
    with _sides() as (net, stack):
        address = f"tcp://{net.x_ip}:5711"
        router = _side(stack, net.a, "router", address, cfg)
        dealer = _side(stack, net.b, "dealer", address, cfg)  # started together: each takes seconds to import
        router.expect("bound", 30)
        dealer.expect("connecting", 30)
        router.expect("got", 10)
        _ip_in(net.b, "link", "set", net.r_dev, "down")
        cut = time.monotonic()
        if unacknowledged:
            router.say()
            router.expect("sent", 5)
        dropped = router.expect("disconnected", 15)
        assert dropped - cut < 5.0, f"dropped {dropped - cut:.1f} s after the cut"


@pytest.mark.slow
def test_the_receiver_reaches_a_sender_host_back_at_an_address_that_dropped_packets() -> None:
    """The receiver connects while the sender's link is cut (its SYNs vanish), and the link comes back 7.5 s later,
    just after the kernel's third SYN retransmit: the next would go 15 s after the first, and ZeroMQ would connect
    again only after 2 min. With a connect timeout of a second, a SYN goes out at least every 2 s."""
    cfg = TransferConfig()
    with _sides() as (net, stack):
        address = f"tcp://{net.x_ip}:5712"
        # Linux 6.5 and later send the first SYN retransmits a second apart (``tcp_syn_linear_timeouts``, 4 by
        # default: SYNs at 0, 1, 2, 3, 4, 5, 7, 11, 19 s) before backing off; the receiver's namespace takes the
        # classic schedule, the one every kernel falls back to, so that the bound below does not depend on the kernel.
        subprocess.run(["ip", "netns", "exec", net.b, "sysctl", "-qw", "net.ipv4.tcp_syn_linear_timeouts=0"],
                       capture_output=True, timeout=10, check=False)  # absent before 6.5: the classic schedule
        net.cut()
        router = _side(stack, net.a, "router", address, cfg)
        dealer = _side(stack, net.b, "dealer", address, cfg)
        router.expect("bound", 30)
        connecting = dealer.expect("connecting", 30)
        time.sleep(max(0.0, connecting + 7.5 - time.monotonic()))
        net.heal()
        healed = time.monotonic()
        arrived = router.expect("got", 15)
        assert arrived - healed < 4.0, (f"reached {arrived - healed:.1f} s after the link came back "
                                        f"({arrived - connecting:.1f} s after the first SYN)")
