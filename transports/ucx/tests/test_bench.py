"""``aioembed bench --transport ucx``: aioembed (two processes) and the raw ucxx send/recv baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from aioembed.bench.baselines import resolve_baseline

from aioembed_ucx.bench import UcxBaseline

RUN = "from aioembed.cli import main; main()"


def test_baseline_entry_point() -> None:
    assert resolve_baseline("ucx") is UcxBaseline


def test_bench_quick_runs_aioembed_and_raw_baseline(tmp_path: Path) -> None:
    config = tmp_path / "ucx.toml"
    config.write_text('[aioembed]\ntransport = "ucx"\n[aioembed.transport_options]\ntls = "tcp"\n')
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "bench", "--quick", "--transport", "ucx", "--config", str(config),
         "--workloads", "sizes,resume,concurrency", "--sizes", "16,8192", "--concurrency", "4", "--mixes", "small",
         "--repeat", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["schema"] == "aioembed-bench/1"
    assert result["transport"] == "ucx"
    assert result["process_model"] == "two"
    raw = result["raw_baseline"]
    assert raw["available"] is True and raw["cross_process"] is True
    assert raw["methods"] == ["send_recv"]
    assert "ep.send" in raw["description"]
    for workload in ("sizes", "resume", "concurrency"):
        points = result["workloads"][workload]["points"]
        assert points, workload
        for p in points:
            assert p["raw_method"] in raw["methods"], p["label"]
            assert {f"raw:{m}" for m in raw["methods"]} <= set(p["samples_s"]), p["label"]
            assert isinstance(p["ratio"], float), p["label"]
            assert isinstance(p["zero_copy_ratio"], float), p["label"]
    assert [p["tokens"] for p in result["workloads"]["sizes"]["points"]] == [16, 8192]
    assert any("process model 'two'" in n for n in result["notes"])
