"""Observability: a small observer interface the sessions call, and a Prometheus exporter.

The sessions never import ``prometheus_client``: they report to a :class:`TransferObserver`
(no-op by default). :class:`PrometheusMetrics` is one implementation, available with the
``aioembed[prometheus]`` extra; a server can write its own (e.g. for OpenTelemetry).
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aioembed.errors import ConfigError, PeerDead, TransferAborted, TransferTimeout

if TYPE_CHECKING:
    from aioembed.session.receiver import EmbeddingReceiver
    from aioembed.session.sender import EmbeddingSender

__all__ = ["PrometheusMetrics", "TransferObserver"]


class TransferObserver:
    """Receives one call per finished room and per finished round. Methods must not block."""

    def room_finished(self, *, side: str, outcome: str, nbytes: int, rounds: int, seconds: float) -> None:
        """A room ended. ``side`` is ``sender`` or ``receiver``; ``outcome`` is ``success``,
        ``failed``, ``aborted``, ``timeout`` or ``peer_dead``; ``nbytes`` counts payload bytes moved."""

    def round_finished(self, *, side: str, seconds: float) -> None:
        """One round of one room ended: on the receiver from INIT/RESUME to STATUS, on the sender
        the write of the round."""

    def sender_room_finished(self, *, sender: str, outcome: str, nbytes: int) -> None:
        """On a receiver: a room (or a part of one) from the sender at ``sender`` ended."""

    def rows_inline(self, *, side: str, nbytes: int) -> None:
        """``nbytes`` of a round's rows rode inside its STATUS instead of a transport write: sent (``sender``)
        or copied into the pool (``receiver``)."""

    def blocks_fenced(self, *, reason: str, blocks: int, sender: str) -> None:
        """A receiver fenced ``blocks`` because a write of ``sender`` may still reach them;
        ``reason``: ``abort_unacked``, ``write_failed``, ``peer_silent``, ``session_dropped``,
        ``writer_gone``."""

    def fence_released(self, *, proof: str, blocks: int, sender: str) -> None:
        """Fenced blocks went back to the pool; ``proof`` says why that is safe (``status``,
        ``abort_ack``, ``fence_release``, ``drained``, ``revoked``, ``writer_gone``, ...)."""

    def disconnect_probed(self, *, sender: str, verdict: str) -> None:
        """On a receiver: the control connection to the sender at ``sender`` dropped (or, the sender found silent,
        the receiver dropped it to connect again), and its address was asked
        whether anything still listens there; ``verdict``: ``refused`` (its process is gone: its blocks are freed
        after the transport's orphan lifetime), ``answered`` (the next handshake tells), ``no_answer`` or
        ``unknown`` (after the sender went silent: its blocks stay fenced, and it is asked again)."""

    def handshake_busy(self) -> None:
        """On a sender: a HELLO was answered ``REJECT(busy)``, ``max_concurrent_handshakes`` being under way (the
        receiver says HELLO again after its back-off). Many of them: receivers restarting together, or a peer
        inventing receiver ids; the setting may be too low for the cluster."""

    def sender_closed(self, *, sender: str) -> None:
        """On a receiver: its connection to the sender at ``sender`` closed (idle for ``sender_idle_timeout``,
        closed to make room under ``max_senders``, or the receiver closing). Per-sender series can go: an
        encoder restarting on a fresh port is a new ``sender`` each time."""


def outcome_of(error: BaseException | None) -> str:
    """The ``outcome`` label for a room that ended with ``error`` (``None``: success)."""
    if error is None:
        return "success"
    if isinstance(error, PeerDead):
        return "peer_dead"
    if isinstance(error, TransferTimeout):
        return "timeout"
    if isinstance(error, TransferAborted):
        return "aborted"
    return "failed"


class PrometheusMetrics(TransferObserver):
    """Prometheus counters, histograms and gauges for aioembed.

    Pass it as ``observer=`` to senders and receivers, and call :meth:`watch_receiver` /
    :meth:`watch_sender` for the live gauges (free blocks, waiters, fenced blocks, held room ids, peers).
    """

    def __init__(self, registry: Any = None, *, namespace: str = "aioembed") -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ConfigError("PrometheusMetrics needs prometheus-client: pip install 'aioembed[prometheus]'") from exc
        reg = registry if registry is not None else prom.REGISTRY
        self.registry = reg
        self._gone: collections.deque[tuple[weakref.ref[Any], list[tuple[Any, tuple[str, ...]]]]] = collections.deque()
        """Series of watched objects that are gone, removed at the next scrape (see :meth:`_unwatch`)."""
        reg.register(_Pruner(self._prune))  # first: each scrape prunes before the gauges are read
        self.transfers = prom.Counter("transfers", "Rooms finished, by side and outcome",
                                      ["side", "outcome"], namespace=namespace, registry=reg)
        self.bytes = prom.Counter("bytes", "Payload bytes moved by finished rooms", ["side"],
                                  namespace=namespace, registry=reg)
        self.rounds = prom.Histogram("rounds", "Rounds per successful room", ["side"], namespace=namespace,
                                     registry=reg, buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
        self.round_seconds = prom.Histogram("round_seconds", "Latency of one round", ["side"],
                                            namespace=namespace, registry=reg,
                                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                     0.25, 0.5, 1, 2.5, 5, 10))
        self.transfer_seconds = prom.Histogram("transfer_seconds", "Duration of a whole room", ["side"],
                                               namespace=namespace, registry=reg,
                                               buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60))
        self.free_blocks = prom.Gauge("free_blocks", "Free blocks in a receiver's pool", ["rank"],
                                      namespace=namespace, registry=reg)
        self.waiters = prom.Gauge("allocator_waiters", "Reservations waiting for free blocks", ["rank"],
                                  namespace=namespace, registry=reg)
        self.fenced = prom.Gauge("fenced_blocks", "Blocks a peer may still write, kept from reuse", ["rank"],
                                 namespace=namespace, registry=reg)
        self.output_cache = prom.Gauge("output_cache_bytes", "Memory of dropped receive() outputs a receiver "
                                       "keeps for the next ones", ["rank"], namespace=namespace, registry=reg)
        self.held_ids = prom.Gauge("room_ids_held", "Room ids a receiver ended with an error and may not open "
                                   "again yet, by why (abort_unanswered: refused; barrier: one round trip)",
                                   ["rank", "why"], namespace=namespace, registry=reg)
        self.rooms = prom.Gauge("rooms_in_flight", "Rooms in flight", ["side"], namespace=namespace,
                                registry=reg)
        self.peers = prom.Gauge("peers_alive", "Receivers connected to a sender", namespace=namespace,
                                registry=reg)
        self.sender_rooms = prom.Counter("sender_rooms", "Rooms (or parts) a receiver got from each sender, "
                                         "by outcome", ["sender", "outcome"], namespace=namespace, registry=reg)
        self.sender_bytes = prom.Counter("sender_bytes", "Payload bytes a receiver got from each sender", ["sender"],
                                         namespace=namespace, registry=reg)
        self.inline_bytes = prom.Counter("inline_bytes", "Bytes of rows carried inside STATUS frames instead of "
                                         "transport writes", ["side"], namespace=namespace, registry=reg)
        self.fences = prom.Counter("blocks_fenced", "Blocks fenced because a write may still reach them",
                                   ["reason", "sender"], namespace=namespace, registry=reg)
        self.fence_releases = prom.Counter("blocks_unfenced", "Fenced blocks released, by the proof that made it safe",
                                           ["proof", "sender"], namespace=namespace, registry=reg)
        self.disconnect_probes = prom.Counter("sender_disconnect_probes", "Probes of a sender's address after its "
                                              "control connection dropped, by verdict (refused: gone)",
                                              ["verdict", "sender"], namespace=namespace, registry=reg)
        self.handshakes_busy = prom.Counter("handshakes_busy", "HELLOs a sender refused as busy (REJECT busy): "
                                            "max_concurrent_handshakes were under way", namespace=namespace,
                                            registry=reg)
        self._watched: dict[tuple[int, tuple[str, ...]], weakref.ref[Any]] = {}
        """(metric, label values) -> the object whose gauge it reads (see :meth:`watch_receiver`)."""
        self._sender_series: dict[str, set[tuple[Any, tuple[str, ...]]]] = {}
        """Per sender: the (metric, label values) series made for it, dropped by :meth:`sender_closed`."""

    def rows_inline(self, *, side: str, nbytes: int) -> None:
        self.inline_bytes.labels(side=side).inc(nbytes)

    def room_finished(self, *, side: str, outcome: str, nbytes: int, rounds: int, seconds: float) -> None:
        self.transfers.labels(side=side, outcome=outcome).inc()
        self.transfer_seconds.labels(side=side).observe(seconds)
        if outcome == "success":
            self.bytes.labels(side=side).inc(nbytes)
            self.rounds.labels(side=side).observe(rounds)

    def round_finished(self, *, side: str, seconds: float) -> None:
        self.round_seconds.labels(side=side).observe(seconds)

    def _per_sender(self, metric: Any, sender: str, *labels: str) -> Any:
        self._sender_series.setdefault(sender, set()).add((metric, labels))
        return metric.labels(*labels)

    def sender_room_finished(self, *, sender: str, outcome: str, nbytes: int) -> None:
        self._per_sender(self.sender_rooms, sender, sender, outcome).inc()
        if outcome == "success":
            self._per_sender(self.sender_bytes, sender, sender).inc(nbytes)

    def blocks_fenced(self, *, reason: str, blocks: int, sender: str) -> None:
        self._per_sender(self.fences, sender, reason, sender).inc(blocks)

    def fence_released(self, *, proof: str, blocks: int, sender: str) -> None:
        self._per_sender(self.fence_releases, sender, proof, sender).inc(blocks)

    def disconnect_probed(self, *, sender: str, verdict: str) -> None:
        self._per_sender(self.disconnect_probes, sender, verdict, sender).inc()

    def handshake_busy(self) -> None:
        self.handshakes_busy.inc()

    def sender_closed(self, *, sender: str) -> None:
        for metric, labels in self._sender_series.pop(sender, ()):
            metric.remove(*labels)

    def watch_receiver(self, receiver: EmbeddingReceiver) -> None:
        """Live gauges read from ``receiver`` at scrape time, while it lives. Held weakly: a receiver the
        application dropped is not kept (with its pool) for the scrape's sake, and its series go with it.
        A later receiver of the same rank takes them over."""
        rank = str(receiver.rank)
        ref = weakref.ref(receiver)
        series = [(self.free_blocks, (rank,), lambda r: r.allocator.stats.free),
                  (self.waiters, (rank,), lambda r: r.allocator.stats.waiters),
                  (self.fenced, (rank,), lambda r: r.allocator.stats.fenced),
                  (self.output_cache, (rank,), lambda r: r.outputs.stats.idle_bytes),
                  (self.held_ids, (rank, "abort_unanswered"), lambda r: r.room_ids_held["abort_unanswered"]),
                  (self.held_ids, (rank, "barrier"), lambda r: r.room_ids_held["barrier"]),
                  (self.rooms, ("receiver",), lambda r: r.rooms_in_flight)]
        self._watch(ref, series)

    def watch_sender(self, sender: EmbeddingSender) -> None:
        """Live gauges read from ``sender`` at scrape time, while it lives (held weakly, as receivers are)."""
        self._watch(weakref.ref(sender), [(self.peers, (), lambda s: len(s.peers)),
                                          (self.rooms, ("sender",), lambda s: s.rooms_in_flight)])

    def _watch(self, ref: weakref.ref[Any],
               series: Sequence[tuple[Any, tuple[str, ...], Callable[[Any], float]]]) -> None:
        for metric, labels, read in series:
            self._watched[(id(metric), labels)] = ref
            child = metric.labels(*labels) if labels else metric
            child.set_function(functools.partial(_read_live, ref, read))
        obj = ref()
        assert obj is not None
        weakref.finalize(obj, self._unwatch, ref, [(m, labels) for m, labels, _ in series])

    def _unwatch(self, ref: weakref.ref[Any], series: list[tuple[Any, tuple[str, ...]]]) -> None:
        """The watched object is gone. Only noted here: a finalizer may run inside any allocation, the
        garbage collector's included, and one inside a gauge's own (non-reentrant) lock would deadlock on
        ``remove()``. The next scrape removes its series."""
        self._gone.append((ref, series))

    def _prune(self) -> None:
        """Remove the series of watched objects that are gone, unless a newer object took them over."""
        while self._gone:
            ref, series = self._gone.popleft()
            self._remove(ref, series)

    def _remove(self, ref: weakref.ref[Any], series: list[tuple[Any, tuple[str, ...]]]) -> None:
        for metric, labels in series:
            if self._watched.get((id(metric), labels)) is not ref:
                continue
            del self._watched[(id(metric), labels)]
            if labels:
                metric.remove(*labels)
            else:
                metric.set(0)


class _Pruner:
    """A collector that yields nothing: registered first, it prunes dropped series at every scrape."""

    def __init__(self, prune: Callable[[], None]) -> None:
        self._prune = prune

    def collect(self) -> list[Any]:
        self._prune()
        return []


def _read_live(ref: weakref.ref[Any], read: Callable[[Any], float]) -> float:
    obj = ref()
    return 0.0 if obj is None else float(read(obj))
