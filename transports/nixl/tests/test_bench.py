"""``aioembed bench --transport nixl``: aioembed (two processes) and the raw NIXL baseline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from aioembed.bench.baselines import moves_cuda, resolve_baseline
from aioembed.config import TransferConfig
from aioembed.samples import standard_layout
from aioembed.testing.bench import check_rows_after_the_clock, run_quick_bench

from aioembed_nixl._dlists import device_id, mem_type
from aioembed_nixl.bench import NixlBaseline, _rows


def test_baseline_entry_point() -> None:
    assert resolve_baseline("nixl") is NixlBaseline


def test_baseline_moves_gpu_memory_as_vram_of_the_sources_device() -> None:
    """With a GPU pool the bench hands CUDA sources; the raw NIXL baseline registers them and its peer's
    destination as VRAM of that device (run GPU to GPU on an H200: see the plugin's README)."""
    assert moves_cuda(NixlBaseline(standard_layout(64), TransferConfig(transport="nixl")))
    for device, want in (("cpu", ("DRAM", 0)), ("cuda:0", ("VRAM", 0)), ("cuda:3", ("VRAM", 3))):
        name = str(torch.device(device))  # how the baseline names its sources' device
        assert (mem_type(name), device_id(name)) == want
    rows = _rows(0x1000, 3, 16, dev=3)
    assert rows.tolist() == [[0x1000, 16, 3], [0x1010, 16, 3], [0x1020, 16, 3]]


def test_bench_quick_runs_aioembed_and_raw_baseline(tmp_path: Path) -> None:
    result = run_quick_bench(tmp_path, "nixl", {"write_timeout": 20.0})
    raw = result["raw_baseline"]
    assert raw["methods"] == ["prepped", "initialize_xfer"] and raw["cuda"] is True
    assert "check_xfer_state" in raw["description"]


def test_the_two_process_bench_checks_rows_after_its_clock_stopped() -> None:
    check_rows_after_the_clock("nixl", {"write_timeout": 20.0})


def test_link_bench_runs_and_checks_what_landed() -> None:
    """``tools/link_bench.py`` (the README's `Link.write`-against-raw numbers) still runs, and its owner's rows are
    compared with the source after each size (the tool exits non-zero if they differ)."""
    tool = Path(__file__).resolve().parents[1] / "tools" / "link_bench.py"
    done = subprocess.run([sys.executable, str(tool), "--sizes", "64,256", "--repeat", "1"], capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 64 |") or line.startswith("| 256 |")]
    assert len(rows) == 2, done.stdout
