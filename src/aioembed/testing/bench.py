"""Shared checks for transport plugins: ``aioembed bench --quick`` runs with their raw baseline, and the
two-process benchmark checks every transfer's rows only once its clock stopped.

Each plugin's test calls :func:`run_quick_bench` and then asserts what is its own (the baseline's
method names and description), and :func:`check_rows_after_the_clock`. Only the shape of the output
and the rows are checked, never a timing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from aioembed.bench.measure import BenchOptions, Measurer, PeerProcessError
from aioembed.bench.workloads import ROOM_OFFSETS
from aioembed.config import TransferConfig

__all__ = ["check_rows_after_the_clock", "run_quick_bench"]

_RUN = "from aioembed.cli import main; main()"


def run_quick_bench(tmp_path: Path, transport: str, options: Mapping[str, str | int | bool]) -> dict[str, Any]:
    """Run a small ``aioembed bench --quick`` over ``transport`` and return its JSON, checked for
    the parts every cross-process transport shares (two processes, a raw baseline on every point, and the
    control floor of every raw method on the sizes points)."""
    config = tmp_path / f"{transport}.toml"
    lines = ["[aioembed]", f"transport = {json.dumps(transport)}", "[aioembed.transport_options]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in options.items()]
    config.write_text("\n".join(lines) + "\n")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, "bench", "--quick", "--transport", transport, "--config", str(config),
         "--workloads", "sizes,resume,concurrency", "--sizes", "16,8192", "--concurrency", "4", "--mixes", "small",
         "--repeat", "1", "--control-floor", "--json", str(out)],
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
    assert result["control_floor"] is True
    for p in result["workloads"]["sizes"]["points"]:
        assert {f"floor:{m}" for m in raw["methods"]} <= set(p["samples_s"]), p["label"]
        assert p["floor_method"] in raw["methods"] and isinstance(p["floor_ratio"], float), p["label"]
    assert any("process model 'two'" in n for n in result["notes"])
    return result


def check_rows_after_the_clock(transport: str, options: Mapping[str, Any]) -> None:
    """The two-process benchmark (receiver in a child) over ``transport``, each receive mode: rows held by the
    child until the parent asks, then checked bit for bit; rows that differ fail the transfer at that check,
    naming the room, and a bad lease is released all the same (the pool holds one request zero-copy, so a
    lease left behind would stop the next one at once); a transfer without a check is not held; a room of a batch
    (``hold=False``) is checked before the child answers; a streamed room's chunks are held and checked alike."""
    n = 1024

    async def main() -> None:
        base = TransferConfig(transport=transport, transport_options=dict(options))
        cfg = base.replace(block_size=128, default_tokens=512, pool_tokens=n, max_round_tokens=None,
                           resume_reserve_tokens=0, round_timeout=10.0)
        m = Measurer(BenchOptions(base_config=base, process_model="two"), None, lambda _step: None)
        src = m.source(n + ROOM_OFFSETS)
        good = [m.opts.seed, n + ROOM_OFFSETS]
        async with m._session(cfg) as pair:
            for mode in ("lease", "out", "copy", "lease"):
                seconds, rounds = await pair.one(m._next_room("t"), src, tokens=n, expected=None, mode=mode,
                                                 check=good)
                assert seconds > 0 and rounds == 2, (mode, seconds, rounds)
            seconds, rounds = await pair.one(m._next_room("unchecked"), src, tokens=n, expected=n, mode="lease",
                                             check=None)
            assert seconds > 0 and rounds == 1
            for mode in ("lease", "out", "copy"):
                room = m._next_room("bad")
                with pytest.raises(PeerProcessError, match=re.escape(
                        f"check failed in the receiver child process: RuntimeError: room {room!r}: the rows "
                        "differ from the source")):
                    await pair.one(room, src, tokens=n, expected=None, mode=mode,
                                   check=[m.opts.seed + 1, n + ROOM_OFFSETS])
                seconds, rounds = await pair.one(m._next_room("after"), src, tokens=n, expected=n, mode="lease",
                                                 check=good)
                assert seconds > 0 and rounds == 1
            bad = [m.opts.seed + 1, n + ROOM_OFFSETS]
            # A room of a batch (hold=False): checked as soon as its rows are in hand, the verdict in the answer.
            seconds, rounds = await pair.one(m._next_room("batch"), src, tokens=n, expected=n, mode="copy",
                                             check=good, hold=False)
            assert seconds > 0 and rounds == 1
            room = m._next_room("batch-bad")
            with pytest.raises(PeerProcessError, match=re.escape(
                    f"recv failed in the receiver child process: RuntimeError: room {room!r}: the rows differ from "
                    "the source")):
                await pair.one(room, src, tokens=n, expected=n, mode="lease", check=bad, hold=False)
            seconds, rounds = await pair.one(m._next_room("after"), src, tokens=n, expected=n, mode="lease",
                                             check=good)  # the bad room's lease was released
            assert seconds > 0 and rounds == 1
            # A streamed room: its chunks held, then checked in token order.
            first, whole, chunks = await pair.stream(m._next_room("s"), src, tokens=n, expected=None,
                                                     chunk_tokens=256, check=good)
            assert 0 < first <= whole and chunks >= 2
            room = m._next_room("s-bad")
            with pytest.raises(PeerProcessError, match=re.escape(
                    f"check failed in the receiver child process: RuntimeError: room {room!r}: the streamed rows "
                    "differ from the source")):
                await pair.stream(room, src, tokens=n, expected=None, chunk_tokens=256, check=bad)
            with pytest.raises(PeerProcessError, match="no room held for command 1000000000"):
                await pair._ask({"op": "check", "of": 10**9})  # type: ignore[attr-defined]

    async def bounded() -> None:
        with anyio.fail_after(120):
            await main()

    anyio.run(bounded)
