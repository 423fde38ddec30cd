"""The speed goals, measured in one run against the raw engine (``aioembed bench --workloads goals``).

=====  ===========================================================  ======================================
point  what                                                         goal
=====  ===========================================================  ======================================
W1     8192 tokens, one at a time: GB/s of each receive mode         leased >= 0.95 x raw, ``out=`` >= 0.90,
                                                                    ``receive()`` >= 0.80
W2     20000 tokens into an 8192-token default reservation (two     rounds <= 1.10 x one round, each mode
       rounds) against the same bytes with ``expected_tokens``
       (one round)
W3     64-token requests, one at a time: p50 latency                p50 <= 1 ms
W3     64-token requests, 32 in flight: requests/s, p99 latency     >= 0.5 x raw requests/s, p99 <= 20 ms
=====  ===========================================================  ======================================

Receive modes: ``leased`` (``receive_leased()``, released after the clock stops), ``out``
(``receive(out=...)`` into buffers reused from room to room, one set per room in flight), ``receive``
(``receive()`` into a fresh output). Every aioembed transfer is checked bit for bit against the source in the receiving
process, outside its timing: in W1 and W2 with the receiver in a child process, only once *both* sides
are done (the child holds the rows until then); in W3 as each room's rows are in hand, so there the
checks share the cores with the rooms still in flight and count in the requests/s. Each room sends its
rows shifted by an offset drawn from its id (:func:`~aioembed.bench.workloads.room_rows`), so rooms that reuse
a pool block do not find an earlier room's identical rows there: a write that landed nowhere fails the check.
The raw baseline checks one write at its setup. Variants run interleaved (a carry-over-balanced order, after an
untimed warm-up: :mod:`aioembed.bench.run_order`). W3 runs a series of rooms that both processes walk in
the same order: latency is from the later of a room's two starts (``send()`` called, receive started) to
both sides done, so no harness round trip is inside it. Raw W3 moves the same 64 tokens one transfer after another.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from aioembed.bench.run_order import balanced_orders
from aioembed.bench.stats import ratio, summarize
from aioembed.bench.workloads import ROOM_OFFSETS

if TYPE_CHECKING:
    import torch

    from aioembed.bench.baselines import RawBaseline
    from aioembed.bench.measure import Measurer, _Pair

__all__ = ["MODES", "goal_rows", "run_goals"]

MODES: tuple[tuple[str, str], ...] = (("leased", "lease"), ("out", "out"), ("receive", "copy"))
"""(variant name, receive mode) of each way the language side can take the rows."""

W1_TOKENS, W2_TOKENS, W3_TOKENS = 8192, 20000, 64


def _goal(goal: str, threshold: str, measured: float | None, met: bool | None, note: str = "") -> dict[str, Any]:
    return {"target": goal, "threshold": threshold, "measured": measured, "met": met, "note": note}


async def _timed_point(m: Measurer, pair: _Pair, baseline: RawBaseline | None, src: Mapping[str, torch.Tensor], *,
                       n: int, reps: int, variants: Sequence[tuple[str, str, int | None]]) -> dict[str, list[float]]:
    """Seconds per transfer of ``n`` rows of ``src`` (``m.source(n + ROOM_OFFSETS)``, shifted by the room) for each
    ``(name, mode, expected_tokens)`` variant and each raw method."""
    check = m.check_of(src)
    names = [v[0] for v in variants] + ([f"raw:{x}" for x in baseline.methods] if baseline else [])
    by_name = {v[0]: v for v in variants}
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep, order in enumerate(balanced_orders(names, reps + 1)):
        for name in order:
            if name.startswith("raw:"):
                assert baseline is not None
                t0 = time.perf_counter()
                await baseline.transfer(name[4:], n)
                dt = time.perf_counter() - t0
            else:
                _, mode, expected = by_name[name]
                dt, _rounds = await pair.one(m._next_room("g"), src, tokens=n, expected=expected, mode=mode,
                                             check=check)
            if rep > 0:  # repetition 0 is the warm-up
                samples[name].append(dt)
    return samples


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _raw_best(samples: Mapping[str, list[float]]) -> tuple[str | None, float | None]:
    raw = {k: summarize(v).median for k, v in samples.items() if k.startswith("raw:") and v}
    if not raw:
        return None, None
    best = min(raw, key=lambda k: raw[k])
    return best, raw[best]


async def _w1(m: Measurer, pair: _Pair, baseline: RawBaseline | None, src: Mapping[str, torch.Tensor],
              reps: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    n = W1_TOKENS
    nbytes = n * m.layout.bytes_per_token
    samples = await _timed_point(m, pair, baseline, src, n=n, reps=reps,
                                 variants=[(name, mode, None) for name, mode in MODES])
    raw_name, raw_t = _raw_best(samples)
    med = {k: summarize(v).median for k, v in samples.items() if v}
    gbps = {k: _gbps(nbytes, t) for k, t in med.items()}
    ratios = {name: ratio(raw_t, med[name]) for name, _ in MODES}
    point = {"label": f"W1: {n} tokens, one at a time", "tokens": n, "bytes": nbytes, "samples_s": samples,
             "gbps": gbps, "raw_method": raw_name, "ratio": ratios}
    goals = []
    for (name, _), want in zip(MODES, (0.95, 0.90, 0.80), strict=True):
        r = ratios[name]
        note = f"{gbps[name]:.2f} GB/s vs raw {gbps[raw_name]:.2f}" if raw_name else "no raw baseline"
        goals.append(_goal(f"W1 {name}: GB/s / raw", f">= {want}", r, None if r is None else r >= want, note))
    return point, goals


async def _w2(m: Measurer, pair: _Pair, baseline: RawBaseline | None, src: Mapping[str, torch.Tensor],
              reps: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    n = W2_TOKENS
    nbytes = n * m.layout.bytes_per_token
    variants = [(f"{name}:{kind}", mode, None if kind == "rounds" else n)
                for name, mode in MODES for kind in ("rounds", "one")]
    samples = await _timed_point(m, pair, baseline, src, n=n, reps=reps, variants=variants)
    raw_name, raw_t = _raw_best(samples)
    med = {k: summarize(v).median for k, v in samples.items() if v}
    over = {name: ratio(med[f"{name}:rounds"], med[f"{name}:one"]) for name, _ in MODES}
    ratios = {v[0]: ratio(raw_t, med[v[0]]) for v in variants}
    point = {"label": f"W2: {n} tokens, default reservation (rounds) vs expected_tokens (one round)", "tokens": n,
             "bytes": nbytes, "samples_s": samples, "gbps": {k: _gbps(nbytes, t) for k, t in med.items()},
             "raw_method": raw_name, "rounds_over_one": over, "ratio": ratios}
    goals = []
    for name, _ in MODES:
        r = over[name]
        rr, ro = ratios[f"{name}:rounds"], ratios[f"{name}:one"]
        note = f"vs raw: rounds {rr:.2f}, one round {ro:.2f}" if rr is not None and ro is not None else ""
        goals.append(_goal(f"W2 {name}: time of rounds / one round", "<= 1.10", r, None if r is None else r <= 1.10,
                           note))
    return point, goals


async def _w3(m: Measurer, pair: _Pair, baseline: RawBaseline | None, src: Mapping[str, torch.Tensor], reps: int, *,
              concurrency: int, rooms: int) -> dict[str, Any]:
    n = W3_TOKENS
    check = m.check_of(src)
    names = [name for name, _ in MODES] + ([f"raw:{x}" for x in baseline.methods] if baseline else [])
    modes = dict(MODES)
    lat: dict[str, list[float]] = {name: [] for name in names}
    rate: dict[str, list[float]] = {name: [] for name in names}
    for rep, order in enumerate(balanced_orders(names, reps + 1)):
        for name in order:
            if name.startswith("raw:"):
                assert baseline is not None
                times = []
                t_all = time.perf_counter()
                for _ in range(rooms):
                    t0 = time.perf_counter()
                    await baseline.transfer(name[4:], n)
                    times.append(time.perf_counter() - t0)
                makespan = time.perf_counter() - t_all
            else:
                ids = [m._next_room("w3") for _ in range(rooms)]
                times, makespan = await pair.series(ids, src, tokens=n, expected=n, mode=modes[name],
                                                    concurrency=concurrency, check=check)
            if rep > 0:
                lat[name].extend(times)
                rate[name].append(rooms / makespan)
    raw_name = max((k for k in names if k.startswith("raw:")), key=lambda k: summarize(rate[k]).median,
                   default=None)
    return {
        "label": f"W3: {n}-token requests, {concurrency} in flight", "tokens": n, "concurrency": concurrency,
        "rooms_per_sample": rooms, "raw_method": raw_name,
        "req_per_s": {k: summarize(v).median for k, v in rate.items() if v},
        "p50_s": {k: summarize(v).median for k, v in lat.items() if v},
        "p99_s": {k: summarize(v).p99 for k, v in lat.items() if v},
        "latencies_s": lat, "req_per_s_samples": rate,
    }


def _w3_goals(one: dict[str, Any], many: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    raw1 = one["raw_method"]
    for name, _ in MODES:
        p50 = one["p50_s"].get(name)
        note = f"{one['req_per_s'][name]:.0f} req/s" + (f", raw p50 {one['p50_s'][raw1] * 1e3:.3f} ms" if raw1 else "")
        out.append(_goal(f"W3 x1 {name}: p50 latency (s)", "<= 0.001", p50, None if p50 is None else p50 <= 0.001,
                         note))
    raw = many["raw_method"]
    for name, _ in MODES:
        r = ratio(many["req_per_s"].get(name), many["req_per_s"].get(raw)) if raw else None  # rates: ours / raw
        note = f"{many['req_per_s'][name]:.0f} req/s vs raw {many['req_per_s'][raw]:.0f}" if raw else "no raw"
        out.append(_goal(f"W3 x32 {name}: req/s / raw", ">= 0.5", r, None if r is None else r >= 0.5, note))
        p99 = many["p99_s"].get(name)
        out.append(_goal(f"W3 x32 {name}: p99 latency (s)", "<= 0.020", p99, None if p99 is None else p99 <= 0.020))
    return out


async def run_goals(m: Measurer) -> dict[str, Any]:
    """W1, W2, W3 x1 and W3 x32 in one session against the raw baseline; see the module doc."""
    opts = m.opts
    cfg = opts.base_config.replace(block_size=128, default_tokens=8192, pool_tokens=65536, max_round_tokens=None)
    reps_big = 3 if opts.quick else max(5, 2 * opts.repeat)
    reps_w3 = 1 if opts.quick else opts.repeat
    rooms1, rooms32 = (40, 96) if opts.quick else (200, 512)
    top = max(W1_TOKENS, W2_TOKENS)
    src = m.source(top)  # the raw baseline's (it moves rows [0, n) every time)
    # What each workload sends, made once (a registered source must be what send() is given), with room for
    # each room's shift (room_rows).
    w1_src, w2_src, small = (m.source(n + ROOM_OFFSETS) for n in (W1_TOKENS, W2_TOKENS, W3_TOKENS))
    points: list[dict[str, Any]] = []
    goals: list[dict[str, Any]] = []
    async with m._session(cfg) as pair, m._baseline(cfg, src, top) as baseline:
        await m.register_sources(pair, w1_src, w2_src, small)
        m.tick(f"goals: W1 ({W1_TOKENS} tokens)")
        point, g = await _w1(m, pair, baseline, w1_src, reps_big)
        points.append(point)
        goals += g
        m.tick("")
        m.tick(f"goals: W2 ({W2_TOKENS} tokens, rounds vs one)")
        point, g = await _w2(m, pair, baseline, w2_src, reps_big)
        points.append(point)
        goals += g
        m.tick("")
        m.tick(f"goals: W3 ({W3_TOKENS}-token requests, 1 and 32 in flight)")
        one = await _w3(m, pair, baseline, small, reps_w3, concurrency=1, rooms=rooms1)
        many = await _w3(m, pair, baseline, small, reps_w3, concurrency=32, rooms=rooms32)
        points += [one, many]
        goals += _w3_goals(one, many)
        m.tick("")
    return {
        "description": (
            "the speed goals: W1 8192 tokens one at a time (GB/s per receive mode); W2 20000 tokens in rounds "
            "(8192-token default) vs one round (expected_tokens); W3 64-token requests one at a time and 32 in "
            "flight (expected_tokens=64); modes leased = receive_leased(), out = receive(out=reused buffers, "
            "one set per room in flight), receive = receive() into a fresh output; every aioembed transfer (its "
            "rows shifted by an offset drawn from the room id) checked bit for bit after its clock stopped; raw = "
            "the transport's raw baseline moving as many rows of the same layout, interleaved"
        ),
        "config": {"transport": cfg.transport, "transport_options": dict(cfg.transport_options),
                   "block_size": cfg.block_size, "default_tokens": cfg.default_tokens,
                   "pool_tokens": cfg.pool_tokens, "max_round_tokens": cfg.max_round_tokens,
                   "copy_threads": cfg.copy_threads, "device": cfg.device},
        "points": points,
        "goals": goals,
    }


def goal_rows(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The goal lines of a ``goals`` workload result (empty if it did not run)."""
    return list(result.get("goals", []))
