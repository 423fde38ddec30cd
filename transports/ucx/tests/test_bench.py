"""``aioembed bench --transport ucx``: aioembed (two processes) and the raw ucxx send/recv baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from aioembed.bench.baselines import resolve_baseline
from aioembed.testing.bench import check_rows_after_the_clock, run_quick_bench

from aioembed_ucx.bench import UcxBaseline

from .conftest import UCX_OPTIONS

OPTIONS = {"tls": "tcp", "progress_mode": UCX_OPTIONS["progress_mode"]}
"""UCX is set up once per process: in the suite's progress mode (AIOEMBED_UCX_TEST_PROGRESS), or every later test
of this process would be refused its own."""


def test_baseline_entry_point() -> None:
    assert resolve_baseline("ucx") is UcxBaseline


def test_bench_quick_runs_aioembed_and_raw_baseline(tmp_path: Path) -> None:
    result = run_quick_bench(tmp_path, "ucx", OPTIONS)
    raw = result["raw_baseline"]
    assert raw["methods"] == ["send_recv"]
    assert "ep.send" in raw["description"]


def test_the_two_process_bench_checks_rows_after_its_clock_stopped() -> None:
    check_rows_after_the_clock("ucx", OPTIONS)


def test_ucx_printing_to_stdout_breaks_neither_the_peer_nor_the_json_report(tmp_path: Path) -> None:
    """UCX logs its warnings to stdout: here, for CUDA transports this host lacks. The receiving child's
    events and ``--json -``'s report share that stdout with it (the child's warning once crashed the bench
    with ``JSONDecodeError``)."""
    config = tmp_path / "ucx-cuda.toml"
    config.write_text('[aioembed]\ntransport = "ucx"\n'
                      '[aioembed.transport_options]\ntls = "tcp,cuda_copy,cuda_ipc"\nhost = "127.0.0.1"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "aioembed", "bench", "--quick", "--config", str(config), "--workloads", "sizes",
         "--sizes", "16", "--repeat", "1", "--json", "-"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # the report alone
    assert [p["tokens"] for p in result["workloads"]["sizes"]["points"]] == [16]
    assert result["process_model"] == "two"
