"""``aioembed bench --transport nixl``: aioembed (two processes) and the raw NIXL baseline."""

from __future__ import annotations

from pathlib import Path

from aioembed.bench.baselines import resolve_baseline
from aioembed.testing.bench import run_quick_bench

from aioembed_nixl.bench import NixlBaseline


def test_baseline_entry_point() -> None:
    assert resolve_baseline("nixl") is NixlBaseline


def test_bench_quick_runs_aioembed_and_raw_baseline(tmp_path: Path) -> None:
    result = run_quick_bench(tmp_path, "nixl", {"write_timeout": 20.0})
    raw = result["raw_baseline"]
    assert raw["methods"] == ["prepped", "initialize_xfer"]
    assert "check_xfer_state" in raw["description"]
