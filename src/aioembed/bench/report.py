"""Turning a benchmark result into targets, a rich table, JSON and a plot."""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["PLOT_HINT", "evaluate_targets", "render", "write_plot"]

PLOT_HINT = "--plot needs matplotlib, an optional extra: pip install 'aioembed[plot]'"


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _target(name: str, threshold: str, measured: float | None, met: bool | None, note: str) -> dict[str, Any]:
    return {"target": name, "threshold": threshold, "measured": measured, "met": met, "note": note}


def evaluate_targets(workloads: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, checked against what this run measured (``met`` is None if not measured)."""
    out: list[dict[str, Any]] = []
    sizes = workloads.get("sizes", {}).get("points", [])
    large = [p for p in sizes if p.get("tokens", 0) >= 8192]
    for key, what in (("ratio", "copying receive()"), ("zero_copy_ratio", "zero-copy receive_leased()")):
        vals = [v for p in large if (v := _num(p.get(key))) is not None]
        worst = min(vals) if vals else None
        at = next((p["label"] for p in large if _num(p.get(key)) == worst), None) if worst is not None else None
        out.append(_target(f"large requests (>= 8192 tokens), {what}: throughput / raw", ">= 0.95", worst,
                           None if worst is None else worst >= 0.95,
                           f"worst point: {at}" if at else "not measured (needs sizes >= 8192 and a raw baseline)"))
    resume = workloads.get("resume", {}).get("summary", {})
    for key, what in (("two_over_one", "copying"), ("zero_copy_two_over_one", "zero-copy")):
        v = _num(resume.get(key))
        if key == "two_over_one" or v is not None:
            out.append(_target(f"resume, {what}: two rounds / one round (time)", "<= 1.10", v,
                               None if v is None else v <= 1.10, "median times" if v is not None else "not measured"))
    conc = workloads.get("concurrency", {}).get("points", [])
    p64 = next((p for p in conc if p.get("mix") == "small" and p.get("concurrency") == 64), None)
    tps = _num(p64.get("transfers_per_s")) if p64 else None
    p50 = _num(p64.get("latency_p50_s")) if p64 else None
    note64 = "small requests, 64 rooms in flight (closed loop)" if p64 else "not measured (needs small x64)"
    out.append(_target("small requests x64 rooms: transfers/s", ">= 2000", tps,
                       None if tps is None else tps >= 2000, note64))
    out.append(_target("small requests x64 rooms: p50 latency (s)", "<= 0.001", p50,
                       None if p50 is None else p50 <= 0.001,
                       note64 + ("; with 64 rooms in flight, Little's law gives p50 ~ 64 / (transfers/s)"
                                 if p64 else "")))
    idle = workloads.get("idle", {})
    v = _num(idle.get("cpu_s_per_s"))
    out.append(_target(f"idle: CPU s/s with {idle.get('rooms', 1000)} pending rooms", "<= 0.01", v,
                       None if v is None else v <= 0.01,
                       "whole process (sender + receiver, all threads): an upper bound on the receiver's share"
                       if v is not None else "not measured"))
    mem = workloads.get("memory", {})
    v = _num(mem.get("ratio"))
    out.append(_target(f"memory: receiver peak RSS / (pool + output), {mem.get('tokens', 50000)} tokens", "<= 1.10",
                       v, None if v is None else v <= 1.10,
                       "child process; source subtracted; sender overhead counted" if v is not None
                       else "not measured"))
    return out


def _fmt_mbps(s: Mapping[str, Any] | None, spread: bool = True) -> str:
    if not s:
        return "-"
    med = s["median_mbps"]
    if not spread:
        return f"{med:,.0f}"
    return f"{med:,.0f} [{s['min_mbps']:,.0f}-{s['max_mbps']:,.0f}]"


def _fmt_ratio(x: Any) -> str:
    v = _num(x)
    return "-" if v is None else f"{v:.2f}"


def _fmt_ms(x: Any) -> str:
    v = _num(x)
    if v is None:
        return "-"
    return f"{v * 1e3:.3f}" if v < 0.01 else f"{v * 1e3:.1f}"


def _fmt_rounds(rounds: Iterable[int]) -> str:
    rs = [r for r in rounds if r]
    if not rs:
        return "-"
    lo, hi = min(rs), max(rs)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _points_table(result: Mapping[str, Any]) -> Table:
    zc = result.get("zero_copy", {}).get("available", False)
    t = Table(title=f"aioembed bench - transport {result['transport']} ({result['mode']} run)", show_lines=False)
    t.add_column("workload")
    t.add_column("size / concurrency")
    t.add_column(escape("aioembed MB/s median [min-max]"), justify="right")
    t.add_column("zero-copy MB/s (ratio)" if zc else "zero-copy", justify="right")
    t.add_column("raw MB/s", justify="right")
    t.add_column("ratio", justify="right")
    t.add_column("rounds", justify="right")
    t.add_column("p50 ms", justify="right")
    t.add_column("transfers/s", justify="right")
    for name, w in result["workloads"].items():
        for p in w.get("points", []):
            summ = p["summary"]
            a = summ.get(p["aioembed_variant"])
            z = summ.get(p["zero_copy_variant"]) if p.get("zero_copy_variant") else None
            raw = summ.get(f"raw:{p['raw_method']}") if p.get("raw_method") else None
            zcell = f"{_fmt_mbps(z, False)} ({_fmt_ratio(p.get('zero_copy_ratio'))})" if z else ("-" if zc else "n/a")
            rawcell = f"{_fmt_mbps(raw, False)}" if raw else "n/a"
            tps = p.get("transfers_per_s")
            t.add_row(name, p["label"], _fmt_mbps(a), zcell, rawcell, _fmt_ratio(p.get("ratio")),
                      _fmt_rounds(p.get("rounds", [])), _fmt_ms(p.get("latency_p50_s")),
                      f"{tps:,.0f}" if _num(tps) is not None else "-")
    return t


def _other_table(result: Mapping[str, Any]) -> Table | None:
    w = result["workloads"]
    rows: list[tuple[str, str, str]] = []
    if "resume" in w:
        s = w["resume"].get("summary", {})
        rows.append(("resume", "two rounds / one round (median time)", _fmt_ratio(s.get("two_over_one"))))
        if "zero_copy_two_over_one" in s:
            rows.append(("resume", "zero-copy: two rounds / one round", _fmt_ratio(s.get("zero_copy_two_over_one"))))
    if "stream" in w:
        st = w["stream"]
        for row in st.get("rows", []):
            how = (f"expected_tokens={row['expected_tokens']}" if row["expected_tokens"] else "default reservation")
            per = f"chunk_tokens={row['chunk_tokens']}" if row["chunk_tokens"] else "one chunk per round"
            rows.append(("stream", f"{st['tokens']} tok, {how}, {per} ({row['chunks']} chunks)",
                         f"first chunk {_fmt_ms(row['first_chunk_s'])} ms, whole {_fmt_ms(row['whole_room_s'])} ms "
                         f"(first/whole {_fmt_ratio(row['first_over_whole'])}; whole / receive() "
                         f"{_fmt_ratio(row['whole_over_receive'])})"))
    if "idle" in w:
        i = w["idle"]
        rows.append(("idle", f"CPU s/s, no rooms ({i['seconds']:g} s)", f"{i['no_rooms']['cpu_s_per_s']:.4f}"))
        rows.append(("idle", f"CPU s/s, {i['rooms']} pending rooms", f"{i['pending_rooms']['cpu_s_per_s']:.4f}"))
    if "memory" in w:
        for mode, m in w["memory"].get("modes", {}).items():
            if "error" in m:
                rows.append(("memory", mode, f"error: {m['error'][:200]}"))
                continue
            mb = 1e6
            rows.append(("memory", f"{mode}: {m['tokens']} tokens, {m['rounds']} round(s)",
                         f"peak extra {m['receiver_bytes'] / mb:,.0f} MB vs pool {m['pool_bytes'] / mb:,.0f} MB + "
                         f"output {m['output_bytes'] / mb:,.0f} MB = ratio {m['ratio']:.3f}"))
    if not rows:
        return None
    t = Table(title="other measurements")
    t.add_column("workload")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for r in rows:
        t.add_row(*r)
    return t


def _targets_table(targets: Iterable[Mapping[str, Any]]) -> Table:
    t = Table(title="targets (benchmarks, not tests)")
    t.add_column("target")
    t.add_column("threshold")
    t.add_column("measured", justify="right")
    t.add_column("met")
    t.add_column("note")
    for tg in targets:
        m = tg["measured"]
        met = {True: "[green]yes[/]", False: "[red]NO[/]", None: "-"}[tg["met"]]
        t.add_row(tg["target"], tg["threshold"], "-" if m is None else f"{m:.4g}", met, tg["note"])
    return t


def render(result: Mapping[str, Any], console: Console) -> None:
    """Print the tables, configs and notes of ``result``."""
    console.print(_points_table(result))
    other = _other_table(result)
    if other is not None:
        console.print(other)
    console.print(_targets_table(result["targets"]))
    for name, w in result["workloads"].items():
        cfg = w.get("config")
        if cfg:
            console.print(f"[bold]{name}[/]: {escape(w.get('description', ''))}")
            console.print(f"    config: block_size={cfg['block_size']} default_tokens={cfg['default_tokens']} "
                          f"pool_tokens={cfg['pool_tokens']} transport={cfg['transport']}", highlight=False)
    m = result["machine"]
    console.print(f"machine: {m['cpu_count']} CPUs ({m['cpus_usable']} usable), load avg at start "
                  f"{m['loadavg_start']}, at end {m.get('loadavg_end')}; python {m['python']}, torch {m['torch']} "
                  f"({m['torch_threads']} threads), aioembed {m['aioembed']}", highlight=False)
    for note in result.get("notes", []):
        console.print(f"note: {note}", highlight=False, markup=False)


def write_plot(result: Mapping[str, Any], path: str) -> None:
    """Throughput vs request size (the ``sizes`` workload), one line per variant."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError as exc:  # checked before the run too; kept for direct callers
        raise RuntimeError(PLOT_HINT) from exc
    points = result["workloads"].get("sizes", {}).get("points", [])
    fig, ax = plt.subplots(figsize=(8, 5))
    if points:
        xs = [p["tokens"] for p in points]
        series: dict[str, list[float]] = {}
        for p in points:
            s = p["summary"]
            series.setdefault("aioembed receive() (copy)", []).append(s[p["aioembed_variant"]]["median_mbps"])
            if p.get("zero_copy_variant"):
                series.setdefault("aioembed receive_leased() (zero-copy)", []).append(
                    s[p["zero_copy_variant"]]["median_mbps"])
            if p.get("raw_method"):
                series.setdefault("raw baseline", []).append(s[f"raw:{p['raw_method']}"]["median_mbps"])
        for label, ys in series.items():
            if len(ys) == len(xs):
                ax.plot(xs, ys, marker="o", label=f"{result['transport']}: {label}")
        ax.set_xscale("log", base=2)
    ax.set_xlabel("request size (tokens)")
    ax.set_ylabel("throughput (MB/s, median)")
    ax.set_title(f"aioembed vs raw, transport {result['transport']} ({result['mode']} run)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
