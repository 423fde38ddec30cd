"""``aioembed bench --transport ucx``: aioembed (two processes) and the raw ucxx send/recv baseline."""

from __future__ import annotations

from pathlib import Path

from aioembed.bench.baselines import resolve_baseline
from aioembed.testing.bench import check_rows_after_the_clock, run_quick_bench

from aioembed_ucx.bench import UcxBaseline


def test_baseline_entry_point() -> None:
    assert resolve_baseline("ucx") is UcxBaseline


def test_bench_quick_runs_aioembed_and_raw_baseline(tmp_path: Path) -> None:
    result = run_quick_bench(tmp_path, "ucx", {"tls": "tcp"})
    raw = result["raw_baseline"]
    assert raw["methods"] == ["send_recv"]
    assert "ep.send" in raw["description"]


def test_the_two_process_bench_checks_rows_after_its_clock_stopped() -> None:
    check_rows_after_the_clock("ucx", {"tls": "tcp"})
