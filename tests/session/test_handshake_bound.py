"""A sender holds at most ``max_concurrent_handshakes`` handshakes (transport connects) at once.

Every HELLO with a new receiver id started a connect held for up to ``handshake_timeout``: a burst of receivers
restarting together, or one peer inventing ids (each HELLO carrying a descriptor of up to 1 MiB), kept any
number of them. A HELLO beyond the bound is answered ``REJECT(busy)`` at once; the receiver says HELLO again
after its usual back-off, and its rooms wait for the handshake as before."""

from __future__ import annotations

import contextlib
import itertools

import anyio
import msgpack
import prometheus_client
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferConfig, TransferStatus
from aioembed.metrics import PrometheusMetrics
from aioembed.protocol.messages import PROTOCOL_VERSION, Hello, Init, Ping, Pong, Reject
from aioembed.session import connection
from aioembed.session.connection import hello_backoff
from aioembed.testing import MockTransport
from aioembed.testing.mock import MockLink

from ..faults.rawpeer import raw_receiver, raw_sender
from .conftest import LAYOUT, assert_same, make_request

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, input_timeout=10.0, handshake_timeout=5.0)


class _GatedConnects(MockTransport):
    """A sender's transport whose connects wait until ``gate`` is set (receivers slow to reach), counting how
    many are in progress at once."""

    def __init__(self, full_at: int) -> None:
        super().__init__()
        self.gate = anyio.Event()
        self.connects = 0
        self.in_progress = 0
        self.most = 0
        self.full = anyio.Event()
        """Set once ``full_at`` connects are in progress together."""
        self._full_at = full_at

    async def connect(self, peer_descriptor: bytes) -> MockLink:
        self.connects += 1
        self.in_progress += 1
        self.most = max(self.most, self.in_progress)
        if self.in_progress >= self._full_at:
            self.full.set()
        try:
            await self.gate.wait()
            return await super().connect(peer_descriptor)
        finally:
            self.in_progress -= 1


class _CountsBusy(PrometheusMetrics):
    """The Prometheus exporter (on a registry of its own), also counting the sender's ``REJECT(busy)`` answers
    here: ``wait_for(n)`` until there were ``n``."""

    def __init__(self) -> None:
        super().__init__(prometheus_client.CollectorRegistry())
        self.busy = 0
        self._changed = anyio.Event()

    def handshake_busy(self) -> None:
        super().handshake_busy()
        self.busy += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, n: int) -> None:
        with anyio.fail_after(10):
            while self.busy < n:
                await self._changed.wait()


async def test_a_burst_of_hellos_holds_at_most_the_bound_and_a_receiver_refused_busy_is_served_later() -> None:
    bound, burst = 3, 10
    cfg = CFG.replace(max_concurrent_handshakes=bound)
    writer = _GatedConnects(full_at=bound)
    counted = _CountsBusy()
    async with EmbeddingSender(LAYOUT, cfg, transport=writer, observer=counted) as sender, \
            raw_receiver(sender.address, LAYOUT, cfg, transport=MockTransport()) as raw:
        for i in range(burst):  # receivers restarting together: each a new id
            raw.send(raw.hello(LAYOUT, cfg, receiver_id=f"restarted-{i}"))
        refused = [await raw.expect(Reject) for _ in range(burst - bound)]  # answered at once, not after a timeout
        assert [r.code for r in refused] == ["busy"] * (burst - bound), refused
        assert all(isinstance(r, Reject) and r.room is None and "max_concurrent_handshakes=3" in r.reason
                   for r in refused)
        with anyio.fail_after(5):
            await writer.full.wait()
        assert (writer.connects, writer.in_progress, writer.most) == (bound, bound, bound)
        assert counted.busy == burst - bound
        assert counted.registry.get_sample_value("aioembed_handshakes_busy_total") == burst - bound
        raw.send(raw.hello(LAYOUT, cfg, receiver_id="restarted-0"))  # a repeat of one under way: ignored, not busy
        raw.send(Ping(nonce=1))
        assert isinstance(await raw.expect(Pong), Pong)  # answered after the HELLO before it was handled
        assert counted.busy == burst - bound and writer.connects == bound

        async with EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport()) as receiver:
            src = make_request(1500, 11)  # two rounds of the 1024-token reservation
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "r", src)
                handle = receiver.start("r")
                # Refused busy, said HELLO again (after its back-off), refused again: its room goes on waiting.
                await counted.wait_for(burst - bound + 2)
                assert not handle.done and writer.connects == bound and writer.most == bound
                writer.gate.set()  # the connects under way end: the receiver's next HELLO is served
                got = await handle.result()
            assert_same(got.tensors, src)
            assert handle.status is TransferStatus.SUCCESS
        assert writer.most == bound


async def test_a_receiver_refused_busy_says_hello_again_and_its_room_waits_for_the_session() -> None:
    """The receiver's side: ``REJECT(busy)`` is neither a refusal of its settings (which fails its rooms as
    ``IncompatiblePeer``) nor a frame to ignore (then the next HELLO came only after ``handshake_timeout``, as the
    room's own wait for the handshake ran out): it says the same HELLO again after its back-off."""
    cfg = CFG.replace(handshake_timeout=3.0)
    busy = msgpack.packb({"type": "REJECT", "v": PROTOCOL_VERSION, "code": "busy",
                          "reason": "busy: 64 handshakes in progress (max_concurrent_handshakes=64); say HELLO again"})
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, cfg, connect=raw.address) as receiver:
        handle = receiver.start("r", sender=raw.address)
        first = await raw.expect(Hello)
        assert isinstance(first, Hello)
        hello = first
        for _ in range(3):
            raw.send_raw(busy)
            hello = await raw.expect(Hello, timeout=1.5)  # its back-off (0.05 s, doubling): well within the deadline
            assert isinstance(hello, Hello)
            assert (hello.receiver_id, hello.epoch) == (first.receiver_id, first.epoch)
            assert not handle.done
        raw.welcome(hello, 0.5)
        init = await raw.expect(Init)  # the room goes on over the session
        assert isinstance(init, Init) and init.room == "r"
        assert not handle.done
        handle.cancel()


def test_hello_backoff_doubles_within_the_upper_half_of_each_step() -> None:
    """Each pause lies in [step/2, step] of a step doubling from 50 ms to 1 s, the draw setting where."""
    steps = [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    for retry, step in enumerate(steps):
        assert hello_backoff(retry, 0.0) == pytest.approx(step / 2)
        assert hello_backoff(retry, 0.999999) == pytest.approx(step, rel=1e-5)
        assert hello_backoff(retry, 0.5) == pytest.approx(0.75 * step)
    assert hello_backoff(10_000, 0.0) == pytest.approx(0.5)  # no overflow far out
    for retry, draw in ((-1, 0.5), (0, 1.0), (0, -0.1)):
        with pytest.raises(ValueError, match="retry"):
            hello_backoff(retry, draw)


async def test_receivers_refused_busy_together_say_hello_again_at_spread_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Receivers refused busy together (a cluster restarting into a sender at its bound) said HELLO again in
    lockstep, after the same 50 ms, 100 ms, 200 ms...: refused together again at every step. Their pauses are drawn
    now: four receivers' pauses differ, and none comes sooner than half its step."""
    pauses: list[tuple[int, float]] = []

    def recorded(retry: int, draw: float) -> float:
        pauses.append((retry, hello_backoff(retry, draw)))
        return pauses[-1][1]

    monkeypatch.setattr(connection, "hello_backoff", recorded)
    cfg = CFG.replace(handshake_timeout=3.0)
    busy = msgpack.packb({"type": "REJECT", "v": PROTOCOL_VERSION, "code": "busy", "reason": "busy: say HELLO again"})
    async with raw_sender() as raw, contextlib.AsyncExitStack() as stack:
        receivers = [await stack.enter_async_context(EmbeddingReceiver(LAYOUT, cfg, connect=raw.address))
                     for _ in range(4)]
        handles = [r.start(f"r{i}", sender=raw.address) for i, r in enumerate(receivers)]
        heard: dict[str, list[float]] = {}
        while sum(len(times) for times in heard.values()) < 4 * 3:  # each receiver's first HELLO and two more
            hello = await raw.expect(Hello, timeout=2.5)
            assert isinstance(hello, Hello)
            heard.setdefault(hello.receiver_id, []).append(anyio.current_time())
            raw.send_raw(busy)
        assert len(heard) == 4 and all(not h.done for h in handles)
        for h in handles:
            h.cancel()
    firsts = [pause for retry, pause in pauses if retry == 0]
    assert len(firsts) >= 4 and len(set(firsts)) == len(firsts), pauses  # drawn, not one fixed 50 ms
    for times in heard.values():
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert all(gap >= 0.025 for gap in gaps), gaps  # at least half of the first step
