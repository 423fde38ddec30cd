"""Turning a benchmark result into rich tables and a plot (needs the ``cli`` extra: ``rich``)."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aioembed.bench.targets import number

__all__ = ["PLOT_HINT", "render", "write_plot"]

PLOT_HINT = "--plot needs matplotlib, an optional extra: pip install 'aioembed[plot]'"


def _num(x: Any) -> float | None:
    return number(x)


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
    floor = result.get("control_floor", False)
    if floor:
        t.add_column("floor", justify="right")
    for name, w in result["workloads"].items():
        if name == "goals":
            continue  # its own table below
        for p in w.get("points", []):
            summ = p["summary"]
            a = summ.get(p["aioembed_variant"])
            z = summ.get(p["zero_copy_variant"]) if p.get("zero_copy_variant") else None
            raw = summ.get(f"raw:{p['raw_method']}") if p.get("raw_method") else None
            zcell = f"{_fmt_mbps(z, False)} ({_fmt_ratio(p.get('zero_copy_ratio'))})" if z else ("-" if zc else "n/a")
            rawcell = f"{_fmt_mbps(raw, False)}" if raw else "n/a"
            tps = p.get("transfers_per_s")
            cells = [name, p["label"], _fmt_mbps(a), zcell, rawcell, _fmt_ratio(p.get("ratio")),
                     _fmt_rounds(p.get("rounds", [])), _fmt_ms(p.get("latency_p50_s")),
                     f"{tps:,.0f}" if _num(tps) is not None else "-"]
            if floor:
                cells.append(_fmt_ratio(p.get("floor_ratio")))
            t.add_row(*cells)
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


def _goals_table(goals: Mapping[str, Any]) -> Table:
    """W1/W2 in GB/s and W3 in requests/s, per receive mode and raw."""
    t = Table(title=f"speed goals - transport {goals['config']['transport']} (medians)")
    t.add_column("point")
    for col in ("leased", "out=", "receive()", "raw"):
        t.add_column(col, justify="right")
    for p in goals.get("points", []):
        raw = p.get("raw_method")
        if "gbps" in p and "rounds_over_one" not in p:
            cells = [f"{p['gbps'][m]:.2f} GB/s ({_fmt_ratio(p['ratio'][m])})" for m in ("leased", "out", "receive")]
            t.add_row(p["label"], *cells, f"{p['gbps'][raw]:.2f} GB/s" if raw else "n/a")
        elif "gbps" in p:
            for kind in ("rounds", "one"):
                cells = [f"{p['gbps'][f'{m}:{kind}']:.2f} GB/s ({_fmt_ratio(p['ratio'][f'{m}:{kind}'])})"
                         for m in ("leased", "out", "receive")]
                t.add_row(f"{p['label']}: {kind}", *cells, f"{p['gbps'][raw]:.2f} GB/s" if raw else "n/a")
        else:
            tail = "p99" if p["concurrency"] > 1 else "p50"
            key = f"{tail}_s"
            cells = [f"{p['req_per_s'][m]:,.0f} req/s ({tail} {_fmt_ms(p[key][m])} ms)"
                     for m in ("leased", "out", "receive")]
            t.add_row(p["label"], *cells,
                      f"{p['req_per_s'][raw]:,.0f} req/s ({tail} {_fmt_ms(p[key][raw])} ms)" if raw else "n/a")
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
    if any(name != "goals" for name in result["workloads"]):
        console.print(_points_table(result))
    if "goals" in result["workloads"]:
        console.print(_goals_table(result["workloads"]["goals"]))
    other = _other_table(result)
    if other is not None:
        console.print(other)
    console.print(_targets_table(result["targets"]))
    for name, w in result["workloads"].items():
        cfg = w.get("config")
        if cfg:
            console.print(f"[bold]{name}[/]: {escape(w.get('description', ''))}")
            console.print(f"    config: block_size={cfg['block_size']} default_tokens={cfg['default_tokens']} "
                          f"pool_tokens={cfg['pool_tokens']} transport={cfg['transport']} "
                          f"device={cfg.get('device', 'cpu')}", highlight=False)
    m = result["machine"]
    console.print(f"machine: {m['cpu_count']} CPUs ({m['cpus_usable']} usable), load avg at start "
                  f"{m['loadavg_start']}, at end {m.get('loadavg_end')}; python {m['python']}, torch {m['torch']} "
                  f"({m['torch_threads']} threads), aioembed {m['aioembed']}"
                  + (f"; GPU {m['gpu']} (torch CUDA {m.get('torch_cuda')})" if m.get("gpu") else ""), highlight=False)
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
