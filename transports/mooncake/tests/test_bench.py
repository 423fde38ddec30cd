"""``aioembed bench --transport mooncake``: aioembed (two processes) and the raw TransferEngine baseline."""

from __future__ import annotations

from pathlib import Path

from aioembed.bench.baselines import resolve_baseline
from aioembed.testing.bench import check_rows_after_the_clock, run_quick_bench

from aioembed_mooncake.bench import MooncakeBaseline


def test_baseline_entry_point() -> None:
    assert resolve_baseline("mooncake") is MooncakeBaseline


def test_bench_quick_runs_aioembed_and_raw_baseline(tmp_path: Path) -> None:
    result = run_quick_bench(tmp_path, "mooncake", {"protocol": "tcp"})
    raw = result["raw_baseline"]
    assert raw["methods"] == ["batch_write", "batch_write_split"]
    assert "batch_transfer_sync_write" in raw["description"]


def test_the_two_process_bench_checks_rows_after_its_clock_stopped() -> None:
    check_rows_after_the_clock("mooncake", {"protocol": "tcp"})
