"""A shared check for transport plugins: ``aioembed bench --quick`` runs with their raw baseline.

Each plugin's test calls :func:`run_quick_bench` and then asserts what is its own (the baseline's
method names and description). Only the shape of the output is checked, never a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["run_quick_bench"]

_RUN = "from aioembed.cli import main; main()"


def run_quick_bench(tmp_path: Path, transport: str, options: Mapping[str, str | int | bool]) -> dict[str, Any]:
    """Run a small ``aioembed bench --quick`` over ``transport`` and return its JSON, checked for
    the parts every cross-process transport shares (two processes, a raw baseline on every point)."""
    config = tmp_path / f"{transport}.toml"
    lines = ["[aioembed]", f"transport = {json.dumps(transport)}", "[aioembed.transport_options]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in options.items()]
    config.write_text("\n".join(lines) + "\n")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, "bench", "--quick", "--transport", transport, "--config", str(config),
         "--workloads", "sizes,resume,concurrency", "--sizes", "16,8192", "--concurrency", "4", "--mixes", "small",
         "--repeat", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["schema"] == "aioembed-bench/1"
    assert result["transport"] == transport
    assert result["process_model"] == "two"
    raw = result["raw_baseline"]
    assert raw["available"] is True and raw["cross_process"] is True
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
    return result
