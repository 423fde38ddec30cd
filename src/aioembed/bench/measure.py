"""The measurements: each workload runs aioembed and the raw baseline side by side, alternating.

Every measured point runs its variants interleaved, after one untimed warm-up of each, in a
carry-over-balanced order (:mod:`aioembed.bench.run_order`: within the repetitions of a cycle, each
variant runs in each position and directly after every other one equally often), so slow drifts of a noisy
machine, and what one variant leaves behind for the next, hit all variants alike:

* ``aioembed``: the receiver's copying ``receive()`` and the sender's ``send()`` started
  together; timed until both have returned (the rows are then in a fresh output tensor);
* ``zero_copy``: the same with ``receive_leased()`` (when the receiver has it): timed until
  ``send()`` has returned and the lease is in hand; the lease is released after the clock stops;
* ``raw:<method>``: the transport's raw baseline moving the same source bytes.

The rows of every aioembed room are checked bit for bit against what was sent, outside its time (:meth:`_Pair.one`).

Process model: with ``process_model="two"`` (the default for a transport whose
``capabilities.cross_process`` is true) the sender runs in this process and the receiver in a
child process (:mod:`aioembed.bench.peer`), as in a real deployment; the child reports when the
rows are in hand on the shared monotonic clock. With ``"one"`` (loopback, which cannot cross
processes) both run here. The ``idle`` workload always runs both sides in this process, and
``memory`` in one child process (see their descriptions).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import torch

from aioembed.bench.baselines import RawBaseline
from aioembed.bench.control_floor import ControlFloor
from aioembed.bench.event_channel import last_event, parse_event
from aioembed.bench.run_order import balanced_orders
from aioembed.bench.start_line import reach, start_at
from aioembed.bench.stats import mbps, ratio, summarize
from aioembed.bench.workloads import (
    REQUEST_MIXES,
    ROOM_OFFSETS,
    TRACE_KINDS,
    OutBuffers,
    check_receive_mode,
    chunk_rows,
    concurrency_sizes,
    generate_trace,
    make_source,
    room_offset,
    room_rows,
    rows_by_offset,
    take_room,
    trace_summary,
)
from aioembed.config import TransferConfig
from aioembed.errors import ConfigError
from aioembed.layout import Layout
from aioembed.protocol.room import TransferStatus
from aioembed.samples import same_rows, standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender

__all__ = [
    "WORKLOADS",
    "BenchOptions",
    "Measurer",
    "config_dict",
    "has_zero_copy",
    "plan_steps",
]

log = logging.getLogger("aioembed.bench")

WORKLOADS: tuple[str, ...] = ("goals", "sizes", "concurrency", "resume", "trace", "senders", "stream", "idle",
                              "memory")

Tick = Callable[[str], None]
"""Progress callback: called with a description when a point starts (``"> ..."``) and ends."""


def has_zero_copy() -> bool:
    """True when this aioembed's receiver offers ``receive_leased`` (the zero-copy receive)."""
    return hasattr(EmbeddingReceiver, "receive_leased")


def config_dict(cfg: TransferConfig) -> dict[str, Any]:
    """The settings of ``cfg`` that shape a benchmark, as plain JSON values."""
    return {
        "transport": cfg.transport,
        "transport_options": dict(cfg.transport_options),
        "block_size": cfg.block_size,
        "default_tokens": cfg.default_tokens,
        "pool_tokens": cfg.pool_tokens,
        "max_round_tokens": cfg.max_round_tokens,
        "copy_threads": cfg.copy_threads,
        "device": cfg.device,
    }


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass
class BenchOptions:
    """What to run (from the command line)."""

    base_config: TransferConfig
    quick: bool = False
    repeat: int = 7
    sizes: tuple[int, ...] = ()
    concurrency: tuple[int, ...] = ()
    mixes: tuple[str, ...] = ("small", "medium")
    workloads: tuple[str, ...] = WORKLOADS
    seed: int = 0
    hidden: int = 3584
    trace_requests: int = 100
    trace_concurrency: int = 4
    resume_tokens: int = 16384
    idle_rooms: int = 1000
    idle_seconds: float = 10.0
    memory_tokens: int = 50000
    senders: int = 4
    """Encoders of the many-senders workload."""
    senders_tokens: int = 4096
    """Tokens per room of the many-senders workload."""
    stream_tokens: int = 100000
    """Tokens of the streaming workload's request."""
    process_model: str = "one"
    """``"one"``: sender and receiver in this process; ``"two"``: the receiver in a child process."""
    registered_sources: bool = False
    """The source tensors of the goals and sizes workloads are registered once with the sender
    (``register_sources()``), as an encoder with long-lived output buffers would: ``send()`` neither stages
    nor registers per request."""
    gc_freeze: bool = False
    """Both processes move every object alive once a workload's sender and receiver are up out of the garbage
    collector's sight (``gc.collect(); gc.freeze()``), as vLLM and SGLang servers do after start-up: full
    collections then scan only what was made since, instead of the 190,000 objects torch brings."""
    control_floor: bool = False
    """The sizes workload also times each raw method framed by the two control messages of aioembed's protocol
    (:mod:`aioembed.bench.control_floor`): ``floor:<method>`` samples, and per point, for the raw method that
    counts, ``floor_ratio`` = raw / floor and ``floor_overhead_s`` = floor - raw (medians). A reference for
    aioembed's own cost, not a bound on every design. Needs a raw baseline that crosses processes."""

    @property
    def transport(self) -> str:
        return self.base_config.transport


def plan_steps(opts: BenchOptions) -> int:
    """Number of progress steps the run will take."""
    n = 0
    for w in opts.workloads:
        if w == "sizes":
            n += len(opts.sizes)
        elif w == "concurrency":
            n += len(opts.concurrency) * len(opts.mixes)
        elif w == "memory":
            n += 2 if has_zero_copy() else 1
        elif w == "goals":
            n += 3
        else:
            n += 1
    return n


_BATCH_CHECKED = ("; every aioembed room's rows (shifted by an offset drawn from the room id) checked bit for bit as "
                  "they are in hand, with the other rooms in flight (the checks count in the makespan, not in the "
                  "room's latency)")
"""What the batch workloads (concurrency, trace, senders) say of their checks."""


@dataclass
class _Series:
    """Timed samples of the variants of one point, plus what the aioembed runs reported."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    rounds: dict[str, list[int]] = field(default_factory=dict)

    def add(self, variant: str, seconds: float, rounds: int | None = None) -> None:
        self.samples.setdefault(variant, []).append(seconds)
        if rounds is not None:
            self.rounds.setdefault(variant, []).append(rounds)


def summarize_point(
    *, workload: str, label: str, nbytes: int, series: _Series, aioembed: str = "aioembed",
    zero_copy: str = "zero_copy", raw_methods: Sequence[str] = (), transfers: int = 1,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A point's JSON record: raw samples, summaries, throughputs and ratios.

    ``nbytes`` is what one sample moves; ``transfers`` how many transfers one sample holds.
    The ratio is aioembed's median throughput over raw's (raw = the raw method with the
    smallest median time), equivalently raw's median time over aioembed's.
    """
    summaries: dict[str, dict[str, float]] = {}
    for variant, xs in series.samples.items():
        s = summarize(xs)
        d = s.to_dict()
        d.update(
            median_mbps=mbps(nbytes, s.median), min_mbps=mbps(nbytes, s.max), max_mbps=mbps(nbytes, s.min),
            q1_mbps=mbps(nbytes, s.q3), q3_mbps=mbps(nbytes, s.q1),
            median_transfers_per_s=transfers / s.median if s.median > 0 else float("inf"),
        )
        summaries[variant] = d
    raw_best: str | None = None
    present = [m for m in raw_methods if f"raw:{m}" in summaries]
    if present:
        raw_best = min(present, key=lambda m: summaries[f"raw:{m}"]["median"])
    raw_t = summaries[f"raw:{raw_best}"]["median"] if raw_best else None
    a_t = summaries[aioembed]["median"] if aioembed in summaries else None
    z_t = summaries[zero_copy]["median"] if zero_copy in summaries else None
    rounds = series.rounds.get(aioembed, [])
    rec: dict[str, Any] = {
        "workload": workload,
        "label": label,
        "bytes_per_sample": nbytes,
        "transfers_per_sample": transfers,
        "samples_s": series.samples,
        "rounds": rounds,
        "summary": summaries,
        "aioembed_variant": aioembed,
        "zero_copy_variant": zero_copy if zero_copy in summaries else None,
        "raw_method": raw_best,
        "ratio": ratio(raw_t, a_t),
        "zero_copy_ratio": ratio(raw_t, z_t),
    }
    if raw_best is not None and f"floor:{raw_best}" in summaries:  # the same method, framed
        floor_t = summaries[f"floor:{raw_best}"]["median"]
        rec["floor_method"] = raw_best
        rec["floor_ratio"] = ratio(raw_t, floor_t)
        rec["floor_overhead_s"] = floor_t - raw_t if raw_t is not None else None
    if extra:
        rec.update(extra)
    return rec


class _Pair(ABC):
    """Sender(s) and receiver of one workload: runs one transfer and times it.

    ``via`` picks the sender (of ``senders``) that serves the room; the receiver names it per room.
    """

    senders: list[EmbeddingSender]

    @abstractmethod
    async def one(self, room: str, data: Mapping[str, torch.Tensor], *, tokens: int, expected: int | None,
                  mode: str, check: list[int] | None, via: int = 0, hold: bool = True) -> tuple[float, int]:
        """One transfer of ``tokens`` rows of ``data``, shifted by the room (:func:`room_rows`), through sender
        ``via``, received as ``mode`` says (``copy``: ``receive()``, ``out``: ``receive(out=...)`` into reused
        buffers, one set per room in flight, ``lease``: ``receive_leased()``); the rows are checked against the
        source (``check = [seed, top]``: ``data`` is ``make_source(layout, top, seed)``) after the clock stopped:
        with ``hold`` once both sides are done (a room timed on its own), without as soon as the rows are in hand
        (a room of a batch, whose checks share the cores with the rooms still in flight, as W3's do). (seconds,
        rounds)."""

    @abstractmethod
    async def series(self, rooms: Sequence[str], data: Mapping[str, torch.Tensor], *, tokens: int,
                     expected: int | None, mode: str, concurrency: int,
                     check: list[int] | None) -> tuple[list[float], float]:
        """``rooms`` in order (each as in :meth:`one`), ``concurrency`` at a time on both sides, each side starting a
        room as soon as one of its workers is free: (per-room latency from the later of its two starts to both
        sides done, makespan). Rows checked as in :meth:`one` without ``hold``."""

    @abstractmethod
    async def stream(self, room: str, data: Mapping[str, torch.Tensor], *, tokens: int, expected: int | None,
                     chunk_tokens: int, check: list[int] | None) -> tuple[float, float, int]:
        """One streamed transfer (``receiver.stream()``, copying) of ``tokens`` rows of ``data`` shifted by the
        room, its chunks checked as :meth:`one` checks a room's rows: (seconds to the first chunk, seconds to the
        last, chunks)."""


class _LocalPair(_Pair):
    """Both sides in this process."""

    def __init__(self, senders: list[EmbeddingSender], receiver: EmbeddingReceiver) -> None:
        self.senders = senders
        self.receiver = receiver
        self._out = OutBuffers(receiver.layout, receiver.config.device)

    async def _take(self, room: str, data: Mapping[str, torch.Tensor], expected: int | None, mode: str,
                    check: bool, *, slot: int = 0, via: int = 0) -> tuple[float, int, Callable[[], None]]:
        """The receiving side of one room from sender ``via`` (``out`` mode: into worker ``slot``'s buffers):
        (``time.perf_counter()`` with the rows in hand, rounds, ``finish``). ``finish()`` compares the rows with
        ``data`` (with ``check``) and lets them go (a lease is released either way); it raises if they differ."""
        out = self._out.get(slot, next(iter(data.values())).shape[0]) if mode == "out" else None
        return await take_room(self.receiver, room, mode, expected=expected, sender=self.senders[via].address,
                               out=out, same=lambda rows: not check or same_rows(rows, data),
                               clock=time.perf_counter, error=PeerProcessError)

    async def _receive(self, room: str, data: Mapping[str, torch.Tensor], expected: int | None, mode: str,
                       check: bool, *, slot: int = 0) -> tuple[float, int]:
        """:meth:`_take`, the rows checked as soon as they are in hand: (when they were, rounds)."""
        t, rounds, finish = await self._take(room, data, expected, mode, check, slot=slot)
        finish()
        return t, rounds

    async def one(self, room: str, data: Mapping[str, torch.Tensor], *, tokens: int, expected: int | None,
                  mode: str, check: list[int] | None, via: int = 0, hold: bool = True) -> tuple[float, int]:
        """Timed until both ``send()`` has returned and the rows are in hand; the rows are checked after that,
        ``hold`` or not (one loop runs both sides: a check before ``send()`` returned would hold it up)."""
        check_receive_mode(mode)
        sender = self.senders[via]
        rows = room_rows(data, room, tokens)
        sent = [0.0]

        async def sending() -> None:
            await sender.send(room, rows)
            sent[0] = time.perf_counter()

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sending)
            t, rounds, finish = await self._take(room, rows, expected, mode, bool(check), via=via)
        finish()
        return max(t, sent[0]) - t0, rounds

    async def series(self, rooms: Sequence[str], data: Mapping[str, torch.Tensor], *, tokens: int,
                     expected: int | None, mode: str, concurrency: int,
                     check: list[int] | None) -> tuple[list[float], float]:
        check_receive_mode(mode)
        n = len(rooms)
        starts, ends, send_starts, send_ends = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        recv_it, send_it = iter(enumerate(rooms)), iter(enumerate(rooms))
        by_offset = rows_by_offset(data, tokens)

        async def receiving(slot: int) -> None:
            for i, room in recv_it:
                starts[i] = time.perf_counter()
                ends[i], _ = await self._receive(room, by_offset[room_offset(room)], expected, mode, bool(check),
                                                 slot=slot)

        async def sending() -> None:
            for i, room in send_it:
                send_starts[i] = time.perf_counter()
                await self.senders[0].send(room, by_offset[room_offset(room)])
                send_ends[i] = time.perf_counter()

        async with anyio.create_task_group() as tg:
            for slot in range(min(concurrency, n)):
                tg.start_soon(receiving, slot)
                tg.start_soon(sending)
        return _series_times(starts, ends, send_starts, send_ends)

    async def stream(self, room: str, data: Mapping[str, torch.Tensor], *, tokens: int, expected: int | None,
                     chunk_tokens: int, check: list[int] | None) -> tuple[float, float, int]:
        sender = self.senders[0]
        rows = room_rows(data, room, tokens)
        first, pieces = 0.0, []
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, room, rows)
            async with self.receiver.stream(room, expected_tokens=expected, chunk_tokens=chunk_tokens) as parts:
                async for chunk in parts:
                    pieces.append(chunk)
                    if len(pieces) == 1:
                        first = time.perf_counter() - t0
        end = time.perf_counter() - t0
        if check and not same_rows(chunk_rows(pieces), rows):
            raise PeerProcessError(f"room {room!r}: the streamed rows differ from the source")
        return first, end, len(pieces)


class PeerProcessError(RuntimeError):
    """The receiver child process failed or reported a failed room."""


class _RemotePair(_Pair):
    """The sender here, the receiver in a child process (:mod:`aioembed.bench.peer`).

    Timed from the first of the two calls (``send()`` here, ``receive()`` in the child) until both
    ``send()`` has returned and the child has the rows, on ``time.monotonic`` (one clock for both
    processes). The command's trip through the pipe to the child is the harness's, not aioembed's,
    so it is not counted (the raw baseline has no such trip either): the command names a start line
    that both processes wait for before their call (:mod:`aioembed.bench.start_line`).
    """

    def __init__(self, senders: list[EmbeddingSender], process: anyio.abc.Process, stderr_path: str) -> None:
        self.senders = senders
        self.process = process
        self.stderr_path = stderr_path
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[anyio.Event, list[dict[str, Any]]]] = {}
        self._ready = anyio.Event()
        self._ended: str | None = None
        self._lock = anyio.Lock()

    def stderr_tail(self) -> str:
        try:
            with open(self.stderr_path, errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    async def read_events(self) -> None:
        """Reader task: dispatch the child's JSON lines until it ends."""
        assert self.process.stdout is not None
        buf = b""
        try:
            async for chunk in self.process.stdout:
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    ev = parse_event(line, "bench peer")
                    if ev is None:
                        continue
                    if ev.get("event") == "ready":
                        self._ready.set()
                    elif ev.get("event") == "done":
                        waiter = self._waiting.pop(int(ev["id"]), None)
                        if waiter is not None:
                            waiter[1].append(ev)
                            waiter[0].set()
        finally:
            self._ended = "the receiver child process ended"
            self._ready.set()
            for event, _box in self._waiting.values():
                event.set()
            self._waiting.clear()

    async def wait_ready(self, timeout: float) -> None:
        with anyio.fail_after(timeout):
            await self._ready.wait()
        if self._ended is not None:
            await self._fail(self._ended)

    async def _fail(self, why: str) -> None:
        with anyio.move_on_after(2):
            await self.process.wait()
        raise PeerProcessError(f"{why} (exit code {self.process.returncode}); its stderr ends with:\n"
                               f"{self.stderr_tail()}")

    async def command(self, cmd: Mapping[str, Any]) -> None:
        assert self.process.stdin is not None
        async with self._lock:
            await self.process.stdin.send(json.dumps(cmd).encode() + b"\n")

    async def _send_beside(self, room: str, data: Mapping[str, torch.Tensor], cmd: dict[str, Any],
                           via: int = 0, cid: int | None = None) -> tuple[list[float], dict[str, Any]]:
        """Send ``data`` as ``room`` through sender ``via`` while the child runs ``cmd`` for that room: the
        ``send()``'s start and end (``time.monotonic``), and the child's answer."""
        sent = [0.0, 0.0]
        sender = self.senders[via]
        at = start_at()

        async def sending() -> None:
            sent[0] = await reach(at)
            await sender.send(room, data)
            sent[1] = time.monotonic()

        return sent, await self._ask(dict(cmd, room=room, at=at), sending, via, cid)

    async def _ask(self, cmd: dict[str, Any], sending: Callable[[], Coroutine[Any, Any, None]] | None = None,
                   via: int = 0, cid: int | None = None) -> dict[str, Any]:
        """Send ``cmd`` to the child (receiving from sender ``via``) as command ``cid`` (default: the next
        id), run ``sending`` here meanwhile (if given); the child's answer, once ``sending`` returned too."""
        if self._ended is not None:
            await self._fail(self._ended)
        if cid is None:
            cid = next(self._ids)
        done = anyio.Event()
        box: list[dict[str, Any]] = []
        self._waiting[cid] = (done, box)
        await self.command(dict(cmd, id=cid, sender=self.senders[via].address))
        async with anyio.create_task_group() as tg:
            if sending is not None:
                tg.start_soon(sending)
            await done.wait()
        if not box:
            await self._fail(self._ended or "no answer from the receiver child process")
        ev = box[0]
        if "error" in ev:
            raise PeerProcessError(f"{cmd['op']} failed in the receiver child process: {ev['error']}")
        return ev

    async def one(self, room: str, data: Mapping[str, torch.Tensor], *, tokens: int, expected: int | None,
                  mode: str, check: list[int] | None, via: int = 0, hold: bool = True) -> tuple[float, int]:
        check_receive_mode(mode)
        sent, ev = await self._checked(room, room_rows(data, room, tokens),
                                       {"op": "recv", "expected": expected, "mode": mode, "check": check,
                                        "out_tokens": tokens}, via=via, hold=hold)
        return transfer_time(sent, ev), int(ev.get("rounds") or 0)

    async def _checked(self, room: str, rows: Mapping[str, torch.Tensor], cmd: dict[str, Any], *, via: int = 0,
                       hold: bool = True) -> tuple[list[float], dict[str, Any]]:
        """Send ``rows`` as ``room`` beside the child's ``cmd`` (:meth:`_send_beside`). With ``hold`` and a
        ``check``, the child holds the rows until both sides are done, then checks them: a check that ran as soon as
        the rows were in hand would share the cores with this process's ``send()`` still finishing (and on 2 cores
        measurably slow it: W1 ``out=`` 36.7 -> 41.5 ms). Without ``hold`` the child checks them as soon as they
        are in hand, before it answers."""
        held = hold and bool(cmd.get("check"))
        cid = next(self._ids)
        try:
            sent, ev = await self._send_beside(room, rows, dict(cmd, hold=held), via, cid)
        except BaseException:
            if held:
                await self._let_go(cid)
            raise
        if held:
            try:
                await self._ask({"op": "check", "of": cid})
            except PeerProcessError:
                raise  # the child answered: it let the rows go (they differ, or it held none)
            except BaseException:
                await self._let_go(cid)  # cancelled before the child answered: it must not hold a lease for good
                raise
        return sent, ev

    async def _let_go(self, of: int) -> None:
        """After a failed transfer, have the child let go of rows it may hold for command ``of`` (a lease would
        otherwise keep the pool's blocks for the rest of the session). Best effort, bounded: the transfer's
        own error is what the caller sees."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            try:
                await self._ask({"op": "check", "of": of})
            except PeerProcessError as exc:  # nothing was held (the receive failed too), or the rows differ
                log.debug("bench child, after a failed transfer: %s", exc)

    async def series(self, rooms: Sequence[str], data: Mapping[str, torch.Tensor], *, tokens: int,
                     expected: int | None, mode: str, concurrency: int,
                     check: list[int] | None) -> tuple[list[float], float]:
        check_receive_mode(mode)
        n = len(rooms)
        send_starts, send_ends = [0.0] * n, [0.0] * n
        it = iter(enumerate(rooms))
        by_offset = rows_by_offset(data, tokens)

        async def worker() -> None:
            for i, room in it:
                send_starts[i] = time.monotonic()
                await self.senders[0].send(room, by_offset[room_offset(room)])
                send_ends[i] = time.monotonic()

        async def sending() -> None:
            async with anyio.create_task_group() as tg:
                for _ in range(min(concurrency, n)):
                    tg.start_soon(worker)

        ev = await self._ask({"op": "series", "rooms": list(rooms), "concurrency": concurrency, "expected": expected,
                              "mode": mode, "check": check, "out_tokens": tokens}, sending)
        return _series_times([float(x) for x in ev["starts"]], [float(x) for x in ev["ends"]], send_starts, send_ends)

    async def stream(self, room: str, data: Mapping[str, torch.Tensor], *, tokens: int, expected: int | None,
                     chunk_tokens: int, check: list[int] | None) -> tuple[float, float, int]:
        sent, ev = await self._checked(room, room_rows(data, room, tokens),
                                       {"op": "stream", "expected": expected, "chunk_tokens": chunk_tokens,
                                        "check": check, "out_tokens": tokens})
        t0 = transfer_start(sent, ev)
        return float(ev["t_first"]) - t0, transfer_time(sent, ev), int(ev["chunks"])


def transfer_start(sent: Sequence[float], answer: Mapping[str, Any]) -> float:
    """When a two-process transfer began: the first of ``send()`` here (``sent[0]``) and the child's
    ``receive()`` (its answer's ``t0``) being called."""
    return min(sent[0], float(answer["t0"]))


def transfer_time(sent: Sequence[float], answer: Mapping[str, Any]) -> float:
    """One transfer's time: from :func:`transfer_start` until both calls are done (``sent[1]``, the
    answer's ``t``)."""
    return max(sent[1], float(answer["t"])) - transfer_start(sent, answer)


def _series_times(starts: Sequence[float], ends: Sequence[float], send_starts: Sequence[float],
                  send_ends: Sequence[float]) -> tuple[list[float], float]:
    """Per-room latency (from the later of the two sides' starts to both done) and the makespan."""
    latencies = [max(e, se) - max(s, ss) for s, e, ss, se in zip(starts, ends, send_starts, send_ends, strict=True)]
    first = min(*starts, *send_starts)
    return latencies, max(*ends, *send_ends) - first


def _config_mapping(cfg: TransferConfig) -> dict[str, Any]:
    """Every setting of ``cfg`` as plain JSON values (for the child's ``TransferConfig.from_mapping``)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = dict(v) if isinstance(v, Mapping) else v
    return out


class Measurer:
    """Runs the selected workloads; one instance per benchmark run."""

    def __init__(self, opts: BenchOptions, baseline_factory: Callable[[Layout, TransferConfig], RawBaseline] | None,
                 tick: Tick) -> None:
        self.opts = opts
        self.layout = standard_layout(opts.hidden)
        self.baseline_factory = baseline_factory
        self.tick = tick
        self.zero_copy = has_zero_copy()
        self._room = 0
        self._floor: ControlFloor | None = None

    # -- plumbing ------------------------------------------------------------------------

    def source(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """The rows a workload sends, on the pool's device: a GPU pool is measured GPU to GPU, as an
        encoder and a language model on GPUs move them (a raw baseline gets the same tensors)."""
        return make_source(self.layout, num_tokens, seed=self.opts.seed, device=self.opts.base_config.device)

    def check_of(self, source: Mapping[str, torch.Tensor]) -> list[int]:
        """The ``check`` of rooms whose rows come from ``source`` (one of :meth:`source`'s): ``[seed, its rows]``,
        what the receiving side regenerates it from."""
        return [self.opts.seed, self.layout.validate(source)]

    async def register_sources(self, pair: _Pair, *sources: Mapping[str, torch.Tensor]) -> None:
        """With ``registered_sources``: register ``sources`` once with every sender of ``pair`` (kept until the
        session closes)."""
        if self.opts.registered_sources:
            for sender in pair.senders:
                await sender.register_sources(*(t for src in sources for t in src.values()))

    def _next_room(self, prefix: str) -> str:
        self._room += 1
        return f"bench-{prefix}-{self._room}"

    @asynccontextmanager
    async def _local_session(self, cfg: TransferConfig) -> AsyncIterator[tuple[EmbeddingSender, EmbeddingReceiver]]:
        async with EmbeddingSender(self.layout, cfg) as sender, \
                EmbeddingReceiver(self.layout, cfg, connect=sender.address) as receiver:
            await receiver.wait_connected()
            yield sender, receiver

    @asynccontextmanager
    async def _session(self, cfg: TransferConfig, senders: int = 1) -> AsyncIterator[_Pair]:
        async with AsyncExitStack() as stack:
            opened = [await stack.enter_async_context(EmbeddingSender(self.layout, cfg)) for _ in range(senders)]
            pair: _Pair
            if self.opts.process_model != "two":
                receiver = await stack.enter_async_context(
                    EmbeddingReceiver(self.layout, cfg, connect=opened[0].address))
                for s in opened:
                    await receiver.wait_connected(sender=s.address)
                pair = _LocalPair(opened, receiver)
            else:
                pair = await stack.enter_async_context(self._child_receiver(cfg, opened))
            stack.enter_context(self._frozen_heap())
            yield pair

    @contextmanager
    def _frozen_heap(self) -> Iterator[None]:
        """With ``gc_freeze``: what is alive now (the sessions, torch, the sources) is left out of every collection
        until the workload's session ends (the receiving child freezes its own once connected). ``gc.unfreeze()``
        then unfreezes whatever was frozen, by the bench or before it: the bench is the process's owner."""
        if not self.opts.gc_freeze:
            yield
            return
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()

    @asynccontextmanager
    async def _child_receiver(self, cfg: TransferConfig, senders: list[EmbeddingSender]) -> AsyncIterator[_Pair]:
        """The receiver in a child process (:mod:`aioembed.bench.peer`), connected to every sender."""
        spec = {"config": _config_mapping(cfg), "hidden": self.opts.hidden, "connect": senders[0].address,
                "senders": [s.address for s in senders], "gc_freeze": self.opts.gc_freeze}
        cmd = [sys.executable, "-m", "aioembed.bench.peer", json.dumps(spec)]
        with tempfile.NamedTemporaryFile("w+b", prefix="aioembed-bench-peer-", suffix=".stderr",
                                         delete=False) as err:
            path = err.name
            process = await anyio.open_process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
        pair = _RemotePair(senders, process, path)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pair.read_events)
                try:
                    await pair.wait_ready(timeout=max(60.0, cfg.handshake_timeout * 4))
                    yield pair
                finally:
                    with anyio.CancelScope(shield=True):
                        with anyio.move_on_after(10):
                            try:
                                await pair.command({"op": "exit"})
                                if process.stdin is not None:
                                    await process.stdin.aclose()
                            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                                pass
                            await process.wait()
                        if process.returncode is None:
                            process.kill()
                            await process.wait()
                        tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await process.aclose()
            os.unlink(path)

    @asynccontextmanager
    async def _baseline(self, cfg: TransferConfig, sources: Mapping[str, torch.Tensor],
                        capacity: int) -> AsyncIterator[RawBaseline | None]:
        if self.baseline_factory is None:
            yield None
            return
        b = self.baseline_factory(self.layout, cfg)
        await b.setup(sources, capacity)
        try:
            yield b
        finally:
            await b.aclose()

    @asynccontextmanager
    async def _control_floor(self, baseline: RawBaseline | None) -> AsyncIterator[None]:
        """With ``control_floor`` and a baseline that crosses processes: the floor peer, for ``floor:`` variants."""
        if not self.opts.control_floor:
            yield
            return
        if baseline is None or not baseline.cross_process:
            raise ConfigError(f"--control-floor needs a raw baseline that crosses processes; transport "
                              f"{self.opts.transport!r} has "
                              f"{'none usable here' if baseline is None else 'one in this process'}")
        floor = ControlFloor()
        try:
            await floor.start()
            self._floor = floor
            yield
        finally:
            self._floor = None
            await floor.aclose()

    def _variants(self, baseline: RawBaseline | None, *aioembed: str) -> list[str]:
        vs = list(aioembed)
        if self.zero_copy:
            vs.append("zero_copy")
        if baseline is not None:
            vs.extend(f"raw:{m}" for m in baseline.methods)
            if self._floor is not None:
                vs.extend(f"floor:{m}" for m in baseline.methods)
        return vs

    def _raw_methods(self, baseline: RawBaseline | None) -> tuple[str, ...]:
        return tuple(baseline.methods) if baseline is not None else ()

    # -- sizes ---------------------------------------------------------------------------

    def sizes_config(self) -> TransferConfig:
        top = max(self.opts.sizes)
        pool = max(8192, _round_up(top, 128))
        return self.opts.base_config.replace(block_size=128, default_tokens=8192, pool_tokens=pool,
                                             max_round_tokens=None)

    async def run_sizes(self) -> dict[str, Any]:
        opts, cfg = self.opts, self.sizes_config()
        top = max(opts.sizes)
        src = self.source(top + ROOM_OFFSETS)  # rooms send rows shifted by their id (room_rows), raw rows [0, n)
        check = self.check_of(src)
        bpt = self.layout.bytes_per_token
        points = []
        async with (self._session(cfg) as pair, self._baseline(cfg, src, top) as baseline,
                    self._control_floor(baseline)):
            await self.register_sources(pair, src)
            variants = self._variants(baseline, "aioembed")
            for n in opts.sizes:
                self.tick(f"sizes: {n} tokens")
                nbytes = n * bpt
                reps = opts.repeat if nbytes >= 8_000_000 else opts.repeat * 4
                series = _Series()
                for rep, order in enumerate(balanced_orders(variants, reps + 1)):
                    for v in order:
                        dt, rounds = await self._run_variant(pair, baseline, v, data=src, n=n, expected=None,
                                                             check=check)
                        if rep > 0:  # repetition 0 is the warm-up
                            series.add(v, dt, rounds)
                points.append(summarize_point(
                    workload="sizes", label=f"{n} tok", nbytes=nbytes, series=series,
                    raw_methods=self._raw_methods(baseline),
                    extra={"tokens": n, "latency_p50_s": summarize(series.samples["aioembed"]).median},
                ))
                self.tick("")
        return {
            "description": "one request at a time, sizes in tokens; the receiver does not know the length "
                           "(default reservation), so requests above default_tokens resume; every aioembed "
                           "room's rows (shifted by an offset drawn from the room id) checked bit for bit after "
                           "its clock stopped",
            "config": config_dict(cfg),
            "points": points,
        }

    async def _run_variant(self, pair: _Pair, baseline: RawBaseline | None,
                           variant: str, *, data: Mapping[str, torch.Tensor], n: int,
                           expected: int | None, check: list[int]) -> tuple[float, int | None]:
        """One sample of ``variant``: an aioembed room sends ``n`` rows of ``data`` (``check = [seed, rows of data]``)
        shifted by its id, and they are checked bit for bit after the clock stopped (:meth:`_Pair.one`)."""
        if variant.startswith("raw:"):
            assert baseline is not None
            t0 = time.perf_counter()
            await baseline.transfer(variant[4:], n)
            return time.perf_counter() - t0, None
        if variant.startswith("floor:"):
            assert baseline is not None and self._floor is not None
            method = variant[6:]
            return await self._floor.time(lambda: baseline.transfer(method, n)), None
        lease = variant == "zero_copy" or variant.startswith("zero_copy")
        return await pair.one(self._next_room("z" if lease else "c"), data, tokens=n, expected=expected,
                              mode="lease" if lease else "copy", check=check)

    # -- resume --------------------------------------------------------------------------

    async def run_resume(self) -> dict[str, Any]:
        opts = self.opts
        n = opts.resume_tokens
        default = _round_up(max(128, n // 2), 128)
        # No resume reserve: the pool is exactly the request, so the expected_tokens run fits in one round.
        cfg = opts.base_config.replace(block_size=128, default_tokens=default, pool_tokens=_round_up(n, 128),
                                       max_round_tokens=None, resume_reserve_tokens=0)
        src = self.source(n + ROOM_OFFSETS)  # rooms send rows shifted by their id (room_rows), raw rows [0, n)
        check = self.check_of(src)
        nbytes = n * self.layout.bytes_per_token
        self.tick(f"resume: {n} tokens")
        series = _Series()
        async with self._session(cfg) as pair, self._baseline(cfg, src, n) as baseline:
            variants = ["two_rounds", "one_round"]
            if self.zero_copy:
                variants += ["zero_copy_two_rounds", "zero_copy_one_round"]
            if baseline is not None:
                variants += [f"raw:{m}" for m in baseline.methods]
            for rep, order in enumerate(balanced_orders(variants, opts.repeat * 2 + 1)):
                for v in order:
                    expected = n if v.endswith("one_round") else None
                    dt, rounds = await self._run_variant(pair, baseline, v, data=src, n=n, expected=expected,
                                                         check=check)
                    if rep > 0:
                        series.add(v, dt, rounds)
        raw_methods = self._raw_methods(baseline)
        points = []
        for kind, label in (("two_rounds", f"{n} tok, default {default}"), ("one_round", f"{n} tok, expected")):
            sub = _Series(
                samples={k: v for k, v in series.samples.items()
                         if k in (kind, f"zero_copy_{kind}") or k.startswith("raw:")},
                rounds={k: v for k, v in series.rounds.items() if k in (kind, f"zero_copy_{kind}")},
            )
            points.append(summarize_point(
                workload="resume", label=label, nbytes=nbytes, series=sub, aioembed=kind,
                zero_copy=f"zero_copy_{kind}", raw_methods=raw_methods,
                extra={"tokens": n, "expected_tokens": n if kind == "one_round" else None,
                       "latency_p50_s": summarize(series.samples[kind]).median},
            ))
        two = summarize(series.samples["two_rounds"]).median
        one = summarize(series.samples["one_round"]).median
        summary: dict[str, Any] = {"two_over_one": ratio(two, one)}
        if self.zero_copy:
            summary["zero_copy_two_over_one"] = ratio(summarize(series.samples["zero_copy_two_rounds"]).median,
                                                      summarize(series.samples["zero_copy_one_round"]).median)
        self.tick("")
        return {
            "description": f"{n} tokens with default_tokens={default} (two rounds) vs the same request with "
                           f"expected_tokens={n} (one round); two_over_one = median time ratio; every aioembed "
                           f"room's rows (shifted by an offset drawn from the room id) checked bit for bit after its "
                           f"clock stopped",
            "config": config_dict(cfg),
            "points": points,
            "summary": summary,
        }

    # -- concurrency and trace: batches of transfers -------------------------------------

    async def _batch(self, pair: _Pair, src: Mapping[str, torch.Tensor],
                     sizes: Sequence[int], concurrency: int, *, lease: bool, expected: bool,
                     latencies: list[float] | None, rounds: list[int] | None) -> float:
        """Run ``sizes`` with ``concurrency`` rooms in flight; returns the makespan. Each room sends its rows of
        ``src`` (``make_source`` of at least the largest size + ``ROOM_OFFSETS`` rows) shifted by its id, and the
        receiving side checks them bit for bit as soon as they are in hand: with the rooms still in flight, so the
        checks count in the makespan (as W3's), not in the room's own time."""
        it = iter(enumerate(sizes))
        check = self.check_of(src)
        mode, prefix = ("lease", "z") if lease else ("copy", "c")
        spread = len(pair.senders)

        async def worker() -> None:
            for i, n in it:  # rooms go to the senders in turn
                dt, r = await pair.one(self._next_room(prefix), src, tokens=n, expected=n if expected else None,
                                       mode=mode, check=check, via=i % spread, hold=False)
                if latencies is not None:
                    latencies.append(dt)
                if rounds is not None:
                    rounds.append(r)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(min(concurrency, len(sizes))):
                tg.start_soon(worker)
        return time.perf_counter() - t0

    @staticmethod
    async def _raw_batch(baseline: RawBaseline, method: str, sizes: Sequence[int]) -> float:
        t0 = time.perf_counter()
        for n in sizes:
            await baseline.transfer(method, n)
        return time.perf_counter() - t0

    async def _batch_point(self, pair: _Pair, baseline: RawBaseline | None, *,
                           src: Mapping[str, torch.Tensor], sizes: Sequence[int], concurrency: int,
                           reps: int, expected: bool) -> tuple[_Series, list[float], list[float], list[int]]:
        series = _Series()
        lat: list[float] = []
        zlat: list[float] = []
        rounds: list[int] = []
        variants = self._variants(baseline, "aioembed")
        for rep, order in enumerate(balanced_orders(variants, reps + 1)):
            warm = rep == 0
            for v in order:
                if v.startswith("raw:"):
                    assert baseline is not None
                    dt = await self._raw_batch(baseline, v[4:], sizes)
                elif v == "zero_copy":
                    dt = await self._batch(pair, src, sizes, concurrency, lease=True, expected=expected,
                                           latencies=None if warm else zlat, rounds=None)
                else:
                    dt = await self._batch(pair, src, sizes, concurrency, lease=False, expected=expected,
                                           latencies=None if warm else lat, rounds=None if warm else rounds)
                if not warm:
                    series.add(v, dt)
        series.rounds["aioembed"] = rounds
        return series, lat, zlat, rounds

    def concurrency_config(self) -> TransferConfig:
        return self.opts.base_config.replace(block_size=128, default_tokens=8192, pool_tokens=65536,
                                             max_round_tokens=None)

    async def run_concurrency(self) -> dict[str, Any]:
        opts, cfg = self.opts, self.concurrency_config()
        top = max(REQUEST_MIXES[m][1] for m in opts.mixes)
        src = self.source(top + ROOM_OFFSETS)  # rooms send rows shifted by their id (room_rows), raw rows [0, n)
        bpt = self.layout.bytes_per_token
        points = []
        async with self._session(cfg) as pair, self._baseline(cfg, src, top) as baseline:
            for mix in opts.mixes:
                for c in opts.concurrency:
                    self.tick(f"concurrency: {mix} x{c}")
                    if mix == "small":
                        count = max(2 * c, 32) if opts.quick else max(4 * c, 128)
                    else:
                        count = max(c // 2, 16) if opts.quick else max(c, 32)
                    sizes = concurrency_sizes(mix, count, opts.seed + c)
                    reps = opts.repeat
                    series, lat, zlat, _rounds = await self._batch_point(pair, baseline, src=src, sizes=sizes,
                                                                         concurrency=c, reps=reps, expected=True)
                    ls = summarize(lat)
                    rec = summarize_point(
                        workload="concurrency", label=f"{mix} x{c}", nbytes=sum(sizes) * bpt, series=series,
                        raw_methods=self._raw_methods(baseline), transfers=count,
                        extra={
                            "mix": mix, "concurrency": c, "transfers_per_batch": count,
                            "tokens_range": list(REQUEST_MIXES[mix]),
                            "latencies_s": lat, "zero_copy_latencies_s": zlat,
                            "latency_p50_s": ls.median, "latency_p99_s": ls.p99,
                            "zero_copy_latency_p50_s": summarize(zlat).median if zlat else None,
                            "transfers_per_s": count / summarize(series.samples["aioembed"]).median,
                        },
                    )
                    points.append(rec)
                    self.tick("")
        lo_s, hi_s = REQUEST_MIXES["small"]
        lo_m, hi_m = REQUEST_MIXES["medium"]
        return {
            "description": (
                f"batches of requests (small: {lo_s}..{hi_s} tokens, medium: {lo_m}..{hi_m} tokens, uniform, "
                f"seeded) with N rooms in flight at once (closed loop: a room starts when one ends); the receiver "
                f"passes expected_tokens (the language side knows its placeholder count), so each room takes one "
                f"round; rooms wait for free blocks when N x size exceeds the pool; raw = the same requests "
                f"copied one after another; latency = from start()/send() to both returning{_BATCH_CHECKED}"
            ),
            "config": config_dict(cfg),
            "points": points,
        }

    # -- the speed goals (W1, W2, W3) --------------------------------------------------------

    async def run_goals(self) -> dict[str, Any]:
        """See :mod:`aioembed.bench.goals`."""
        from aioembed.bench.goals import run_goals

        return await run_goals(self)

    # -- streaming -----------------------------------------------------------------------

    async def run_stream(self) -> dict[str, Any]:
        """Time to the first chunk against time to the whole room, and what the extra PROGRESS frames cost."""
        opts = self.opts
        n = opts.stream_tokens
        cfg = self.opts.base_config.replace(block_size=128, default_tokens=8192, pool_tokens=65536,
                                            max_round_tokens=None)
        chunk = cfg.stream_chunk_tokens or 2048
        src = self.source(n + ROOM_OFFSETS)  # rooms send rows shifted by their id (room_rows), raw rows [0, n)
        check = self.check_of(src)
        nbytes = n * self.layout.bytes_per_token
        self.tick(f"stream: {n} tokens")
        variants = ["receive", "stream", "stream_per_round", "receive_expected", "stream_expected"]
        firsts: dict[str, list[float]] = {v: [] for v in variants if v.startswith("stream")}
        chunks: dict[str, int] = {}
        series = _Series()
        async with self._session(cfg) as pair, self._baseline(cfg, src, n) as baseline:
            if baseline is not None:
                variants += [f"raw:{m}" for m in baseline.methods]
            for rep, order in enumerate(balanced_orders(variants, max(2, opts.repeat // 2) + 1)):
                for v in order:
                    expected = n if v.endswith("expected") else None
                    if v.startswith("stream"):
                        per = 0 if v == "stream_per_round" else chunk
                        first, whole, count = await pair.stream(self._next_room("s"), src, tokens=n, expected=expected,
                                                                chunk_tokens=per, check=check)
                        if rep > 0:
                            firsts[v].append(first)
                            series.add(v, whole)
                            chunks[v] = count
                    else:
                        dt, rounds = await self._run_variant(pair, baseline, v if v.startswith("raw:") else
                                                             "aioembed", data=src, n=n, expected=expected,
                                                             check=check)
                        if rep > 0:
                            series.add(v, dt, rounds)
        self.tick("")
        med = {v: summarize(xs).median for v, xs in series.samples.items()}
        first_med = {v: summarize(xs).median for v, xs in firsts.items()}
        rows = []
        for v, whole_with in (("stream", "receive"), ("stream_per_round", "receive"),
                              ("stream_expected", "receive_expected")):
            rows.append({
                "variant": v, "expected_tokens": n if v.endswith("expected") else None,
                "chunk_tokens": 0 if v == "stream_per_round" else chunk, "chunks": chunks.get(v),
                "first_chunk_s": first_med[v], "whole_room_s": med[v],
                "first_over_whole": ratio(first_med[v], med[v]),
                "whole_over_receive": ratio(med[v], med[whole_with]),
            })
        raw = [m for m in med if m.startswith("raw:")]
        return {
            "description": (
                f"one request of {n} tokens received with stream() (copying chunks; chunk_tokens={chunk}, or one "
                "chunk per round) against receive() of the same request; first_chunk_s = time to the first chunk "
                "in hand, whole_room_s = to the last; whole_over_receive = what announcing rows within rounds "
                "costs; without expected_tokens the room takes rounds from an 8192-token first reservation; every "
                "aioembed room's rows (shifted by an offset drawn from the room id; a stream's chunks in token order) "
                "checked bit for bit after its clock stopped"
            ),
            "config": dict(config_dict(cfg), stream_chunk_tokens=chunk),
            "tokens": n,
            "bytes": nbytes,
            "rows": rows,
            "receive_s": med["receive"],
            "receive_expected_s": med["receive_expected"],
            "raw_s": min((med[m] for m in raw), default=None),
            "samples_s": series.samples,
            "first_chunk_samples_s": firsts,
        }

    # -- many senders --------------------------------------------------------------------

    async def run_senders(self) -> dict[str, Any]:
        """Several encoders into one receiver's pool: aggregate throughput of rooms spread over them."""
        opts, cfg = self.opts, self.concurrency_config()
        k, tokens = opts.senders, opts.senders_tokens
        count = k * (4 if opts.quick else 8)
        concurrency = k * 2
        sizes = [tokens] * count
        src = self.source(tokens + ROOM_OFFSETS)  # rooms send rows shifted by their id (room_rows), raw rows [0, n)
        self.tick(f"senders: {k} encoders x {count // k} rooms of {tokens} tokens")
        async with self._session(cfg, senders=k) as pair, self._baseline(cfg, src, tokens) as baseline:
            series, lat, _zlat, _rounds = await self._batch_point(pair, baseline, src=src, sizes=sizes,
                                                                  concurrency=concurrency, reps=opts.repeat,
                                                                  expected=True)
        ls = summarize(lat)
        point = summarize_point(
            workload="senders", label=f"{k} senders, {count} x {tokens} tok, x{concurrency}",
            nbytes=count * tokens * self.layout.bytes_per_token, series=series,
            raw_methods=self._raw_methods(baseline), transfers=count,
            extra={"senders": k, "tokens": tokens, "concurrency": concurrency, "transfers_per_batch": count,
                   "latency_p50_s": ls.median, "latency_p99_s": ls.p99,
                   "transfers_per_s": count / summarize(series.samples["aioembed"]).median},
        )
        self.tick("")
        return {
            "description": (
                f"{k} encoders (one EmbeddingSender and transport endpoint each, in the benchmark process) into one "
                f"receiver pool ({'a child process' if opts.process_model == 'two' else 'this process'}): "
                f"{count} rooms of {tokens} tokens, room i from encoder i mod {k}, {concurrency} rooms in flight, "
                "expected_tokens given (one round each); throughput = all bytes / makespan (aggregate over the "
                "encoders); raw = the same requests moved one after another by the raw baseline (one endpoint pair)"
                + _BATCH_CHECKED
            ),
            "config": dict(config_dict(cfg), senders=k),
            "points": [point],
        }

    def trace_config(self, largest: int = 0) -> TransferConfig:
        """65536 tokens; with zero-copy measured, at least ``trace_concurrency`` x the largest request:
        a lease needs the whole request in the pool at once, so rooms that each hold part of the pool
        while waiting for the rest would otherwise block one another until ``round_timeout``."""
        pool = 65536
        if self.zero_copy and largest:
            pool = max(pool, _round_up(self.opts.trace_concurrency * largest, 128))
        return self.opts.base_config.replace(block_size=128, default_tokens=8192, pool_tokens=pool,
                                             max_round_tokens=None)

    async def run_trace(self) -> dict[str, Any]:
        opts = self.opts
        trace = generate_trace(opts.trace_requests, seed=opts.seed)
        sizes = [r.tokens for r in trace if r.tokens > 0]
        cfg = self.trace_config(max(sizes, default=0))
        self.tick(f"trace: {len(trace)} requests")
        if not sizes:
            self.tick("")
            return {"description": "empty trace", "config": config_dict(cfg), "points": [],
                    "trace": trace_summary(trace)}
        top = max(sizes)
        src = self.source(top + ROOM_OFFSETS)  # rooms send rows shifted by their id (room_rows), raw rows [0, n)
        nbytes = sum(sizes) * self.layout.bytes_per_token
        async with self._session(cfg) as pair, self._baseline(cfg, src, top) as baseline:
            series, lat, zlat, _rounds = await self._batch_point(
                pair, baseline, src=src, sizes=sizes, concurrency=opts.trace_concurrency,
                reps=max(2, opts.repeat // 2), expected=False)
        ls = summarize(lat)
        point = summarize_point(
            workload="trace", label=f"{len(trace)} req x{opts.trace_concurrency}", nbytes=nbytes, series=series,
            raw_methods=self._raw_methods(baseline), transfers=len(sizes),
            extra={
                "requests": len(trace), "transferred": len(sizes), "concurrency": opts.trace_concurrency,
                "latencies_s": lat, "zero_copy_latencies_s": zlat,
                "latency_p50_s": ls.median, "latency_p99_s": ls.p99,
                "transfers_per_s": len(sizes) / summarize(series.samples["aioembed"]).median,
            },
        )
        self.tick("")
        return {
            "description": (
                f"mixed multimodal trace (seed {opts.seed}, kinds {dict(TRACE_KINDS)}; text-only requests move "
                f"nothing and are skipped), replayed in order with {opts.trace_concurrency} rooms in flight; "
                "the receiver does not know lengths (default reservation; videos resume); throughput = all "
                "bytes / makespan; raw = the same requests copied one after another" + _BATCH_CHECKED
                + (f"; pool_tokens={cfg.pool_tokens} (>= {opts.trace_concurrency} x the largest request, so "
                   "concurrent zero-copy leases cannot starve one another)" if cfg.pool_tokens > 65536 else "")
            ),
            "config": config_dict(cfg),
            "points": [point],
            "trace": dict(trace_summary(trace), seed=opts.seed, requests_list=[r.to_dict() for r in trace]),
        }

    # -- idle ----------------------------------------------------------------------------

    async def run_idle(self) -> dict[str, Any]:
        opts = self.opts
        rooms, secs = opts.idle_rooms, opts.idle_seconds
        bs = 16
        cfg = opts.base_config.replace(
            block_size=bs, default_tokens=bs, pool_tokens=bs * max(rooms, 1), max_round_tokens=None,
            resume_reserve_tokens=0,
            input_timeout=max(60.0, 3 * secs + 30), room_timeout=max(600.0, 3 * secs + 60),
            max_rooms_per_peer=max(4096, rooms),
        )
        self.tick(f"idle: {rooms} pending rooms, {secs:g} s")
        async with self._local_session(cfg) as (sender, receiver):
            await anyio.sleep(0.3)
            empty = await _cpu_over(secs)
            handles = [receiver.start(f"idle-{i}") for i in range(rooms)]

            def all_pending() -> bool:
                return sender.rooms_in_flight >= rooms and all(
                    h.status is TransferStatus.WAITING_FOR_INPUT for h in handles)

            with anyio.fail_after(60):
                while not all_pending():  # noqa: ASYNC110 - the library offers no event for "INIT received"
                    await anyio.sleep(0.05)
            await anyio.sleep(0.3)
            loaded = await _cpu_over(secs)
            for h in handles:
                h.cancel("benchmark over")
            with anyio.fail_after(60):
                for h in handles:
                    await h.wait()
        self.tick("")
        return {
            "description": (
                f"CPU seconds per wall second of one process running sender and receiver together (all threads; "
                f"this workload keeps both sides in the benchmark process in every process model) over "
                f"{secs:g} s with no rooms, then with {rooms} rooms reserved (INIT sent) and no data arriving; "
                "the receiver's share is at most the total"
            ),
            "config": dict(config_dict(cfg), input_timeout=cfg.input_timeout),
            "rooms": rooms,
            "seconds": secs,
            "no_rooms": empty,
            "pending_rooms": loaded,
            "cpu_s_per_s": loaded["cpu_s_per_s"],
            "extra_cpu_s_per_s": loaded["cpu_s_per_s"] - empty["cpu_s_per_s"],
        }

    # -- memory --------------------------------------------------------------------------

    async def run_memory(self) -> dict[str, Any]:
        opts = self.opts
        results: dict[str, Any] = {}
        modes = ["copy", "lease"] if self.zero_copy else ["copy"]
        for mode in modes:
            self.tick(f"memory: {opts.memory_tokens} tokens ({mode}, child process)")
            spec = {"tokens": opts.memory_tokens, "mode": mode, "hidden": opts.hidden,
                    "transport": opts.base_config.transport,
                    "transport_options": dict(opts.base_config.transport_options)}
            cmd = [sys.executable, "-m", "aioembed.bench.memchild", json.dumps(spec)]
            with anyio.fail_after(300):
                proc = await anyio.run_process(cmd, check=False, env=dict(os.environ, PYTHONUNBUFFERED="1"))
            found = last_event(proc.stdout, "memory child")
            if found is not None and found.get("rows_differ"):
                raise PeerProcessError(f"memory workload ({mode}): {found.get('error')}")
            if proc.returncode != 0 or found is None:
                err = proc.stderr.decode(errors="replace")[-2000:]
                results[mode] = {"error": f"child exited {proc.returncode}: {err}"}
            else:
                results[mode] = found
            self.tick("")
        return {
            "description": (
                "peak RSS of a child process running sender and receiver (both in that one process, whatever "
                "the process model) for one request; the source tensors are resident before the measurement starts and "
                "are subtracted; receiver_bytes = peak - RSS with the source ready (so the sender's own overhead "
                "is counted against the receiver: an upper bound); budget = pool + output; ratio = receiver_bytes "
                "/ budget; the room's rows are checked bit for bit once the peak was read"
            ),
            "tokens": opts.memory_tokens,
            "modes": results,
            "ratio": results.get("copy", {}).get("ratio"),
        }


async def _cpu_over(seconds: float) -> dict[str, float]:
    p0 = time.process_time()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    w0 = time.perf_counter()
    await anyio.sleep(seconds)
    wall = time.perf_counter() - w0
    cpu = time.process_time() - p0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "user_s": r1.ru_utime - r0.ru_utime,
        "system_s": r1.ru_stime - r0.ru_stime,
        "voluntary_switches": float(r1.ru_nvcsw - r0.ru_nvcsw),
        "cpu_s_per_s": cpu / wall if wall > 0 else 0.0,
    }
