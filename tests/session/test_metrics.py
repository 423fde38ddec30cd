"""Observability: per-transfer stats, the observer hooks, and the Prometheus exporter."""

from __future__ import annotations

import gc
import threading
import weakref

import anyio
import prometheus_client
import pytest
import torch

from aioembed import EmbeddingReceiver, EmbeddingSender, Field, Layout, TransferConfig, TransferTimeout
from aioembed.metrics import PrometheusMetrics, TransferObserver

from .conftest import LAYOUT, assert_same, make_request

pytestmark = pytest.mark.anyio


class Recorder(TransferObserver):
    def __init__(self) -> None:
        self.rooms: list[dict[str, object]] = []
        self.rounds: list[tuple[str, float]] = []

    def room_finished(self, *, side: str, outcome: str, nbytes: int, rounds: int, seconds: float) -> None:
        self.rooms.append({"side": side, "outcome": outcome, "nbytes": nbytes, "rounds": rounds})

    def round_finished(self, *, side: str, seconds: float) -> None:
        self.rounds.append((side, seconds))


async def test_observer_sees_rooms_and_rounds() -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096, input_timeout=0.5)
    rec = Recorder()
    async with EmbeddingSender(LAYOUT, cfg, observer=rec) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, observer=rec) as receiver:
        src = make_request(3000, 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "m", src)
            got = await receiver.receive("m")
        assert_same(got.tensors, src)
        with pytest.raises(TransferTimeout):
            await receiver.receive("never")
    nbytes = 3000 * LAYOUT.bytes_per_token
    assert {"side": "sender", "outcome": "success", "nbytes": nbytes, "rounds": 2} in rec.rooms
    assert {"side": "receiver", "outcome": "success", "nbytes": nbytes, "rounds": 2} in rec.rooms
    assert any(r["side"] == "receiver" and r["outcome"] == "timeout" for r in rec.rooms)
    assert sum(1 for side, _ in rec.rounds if side == "receiver") == 2
    assert sum(1 for side, _ in rec.rounds if side == "sender") == 2
    assert got.stats.rounds == 2 and got.stats.bytes == nbytes and got.stats.seconds > 0


async def test_prometheus_exporter() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096)
    async with EmbeddingSender(LAYOUT, cfg, observer=metrics) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, observer=metrics) as receiver:
        metrics.watch_sender(sender)
        metrics.watch_receiver(receiver)
        await receiver.wait_connected()
        src = make_request(2500, 2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "p", src)
            await receiver.receive("p")
        text = prometheus_client.generate_latest(registry).decode()
        value = registry.get_sample_value
        assert value("aioembed_transfers_total", {"side": "receiver", "outcome": "success"}) == 1
        assert value("aioembed_transfers_total", {"side": "sender", "outcome": "success"}) == 1
        assert value("aioembed_bytes_total", {"side": "receiver"}) == 2500 * LAYOUT.bytes_per_token
        # Both rounds (1024 and 1476 tokens) carried their token ids inside the STATUS; the positions (24 B a
        # row) did not fit the 8192 bytes beside them.
        ids = 2500 * LAYOUT["token_ids"].row_bytes
        assert value("aioembed_inline_bytes_total", {"side": "sender"}) == ids
        assert value("aioembed_inline_bytes_total", {"side": "receiver"}) == ids
        assert value("aioembed_rounds_count", {"side": "receiver"}) == 1
        assert value("aioembed_round_seconds_count", {"side": "receiver"}) == 2
        assert value("aioembed_free_blocks", {"rank": "0"}) == receiver.allocator.stats.total
        assert value("aioembed_allocator_waiters", {"rank": "0"}) == 0
        assert value("aioembed_peers_alive") == 1
        assert "aioembed_fenced_blocks" in text
        for why in ("abort_unanswered", "barrier"):
            assert value("aioembed_room_ids_held", {"rank": "0", "why": why}) == 0


async def test_watched_gauges_do_not_keep_a_dropped_receiver_alive() -> None:
    """The gauges read a receiver weakly: once the application dropped it, its pool is freed and its series
    go (they kept the receiver, and hundreds of MB of pool, for as long as the registry lived)."""
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096)
    async with EmbeddingSender(LAYOUT, cfg) as sender:
        async with EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
            metrics.watch_sender(sender)
            metrics.watch_receiver(receiver)
            await receiver.wait_connected()
            assert registry.get_sample_value("aioembed_free_blocks", {"rank": "0"}) == 32
            assert registry.get_sample_value("aioembed_peers_alive") == 1
        pool = weakref.ref(receiver.pool)
        del receiver
        gc.collect()
        assert pool() is None
        assert registry.get_sample_value("aioembed_free_blocks", {"rank": "0"}) is None
        assert registry.get_sample_value("aioembed_room_ids_held", {"rank": "0", "why": "barrier"}) is None
        assert registry.get_sample_value("aioembed_rooms_in_flight", {"side": "receiver"}) is None
        assert registry.get_sample_value("aioembed_rooms_in_flight", {"side": "sender"}) == 0


async def test_prometheus_gauge_of_the_output_cache() -> None:
    """The memory of a dropped large output, kept for the next ``receive()``, shows in the gauge."""
    wide = Layout(embeddings=Field((4096,), torch.bfloat16), token_ids=Field((), torch.int32))
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    cfg = TransferConfig(default_tokens=2048, pool_tokens=4096)
    async with EmbeddingSender(wide, cfg) as sender, \
            EmbeddingReceiver(wide, cfg, connect=sender.address) as receiver:
        metrics.watch_receiver(receiver)
        src = make_request(1500, 3, layout=wide)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "w", src)
            got = await receiver.receive("w")
        assert_same(got.tensors, src)
        assert registry.get_sample_value("aioembed_output_cache_bytes", {"rank": "0"}) == 0
        del got
        # back once the caller let go and the room's task ended (it may still be unwinding: a loop turn)
        with anyio.fail_after(5):
            while receiver.outputs.stats.idle_bytes < 1500 * wide["embeddings"].row_bytes:
                await anyio.sleep(0.01)
        kept = receiver.outputs.stats.idle_bytes
        assert registry.get_sample_value("aioembed_output_cache_bytes", {"rank": "0"}) == kept


async def test_per_sender_series_go_when_the_connection_to_that_sender_closes() -> None:
    # An encoder restarting on a fresh port is a new sender label each time: series that stayed for ever
    # grew without bound over a server's life (found by a reviewer).
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096, sender_idle_timeout=0.2)
    async with EmbeddingSender(LAYOUT, cfg) as sender, EmbeddingReceiver(LAYOUT, cfg, observer=metrics) as receiver:
        src = make_request(500, 4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "s", src)
            await receiver.receive("s", sender=sender.address)
        labels = {"sender": sender.address, "outcome": "success"}
        assert registry.get_sample_value("aioembed_sender_rooms_total", labels) == 1
        assert registry.get_sample_value("aioembed_sender_bytes_total", {"sender": sender.address}) == \
            500 * LAYOUT.bytes_per_token
        with anyio.fail_after(5):
            while receiver.senders:  # closed once idle for sender_idle_timeout
                await anyio.sleep(0.02)
            while registry.get_sample_value("aioembed_sender_rooms_total", labels) is not None:
                await anyio.sleep(0.01)  # the connection's tasks end a few loop turns after the close
        assert registry.get_sample_value("aioembed_sender_bytes_total", {"sender": sender.address}) is None
        assert registry.get_sample_value("aioembed_transfers_total", {"side": "receiver", "outcome": "success"}) == 1


def test_a_watched_object_collected_inside_a_gauges_lock_does_not_deadlock() -> None:
    """The cyclic garbage collector runs finalizers inside whatever allocation triggered it, a gauge's own
    (non-reentrant) lock held included: removing the series there hung that thread for good."""
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096)

    async def watched_and_dropped() -> None:
        async with EmbeddingReceiver(LAYOUT, cfg) as receiver:
            metrics.watch_receiver(receiver)
    anyio.run(watched_and_dropped)
    done = threading.Event()

    def collect_inside_the_lock() -> None:
        with metrics.free_blocks._lock:
            gc.collect()
        done.set()

    thread = threading.Thread(target=collect_inside_the_lock, daemon=True)
    thread.start()
    thread.join(10)
    assert done.is_set(), "deadlocked"
    assert registry.get_sample_value("aioembed_free_blocks", {"rank": "0"}) is None  # gone at the scrape
