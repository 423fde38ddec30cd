"""The ``aioembed bench --quick`` command runs end to end and writes well-formed JSON.

Asserts the shape of the output only, never a timing: numbers depend on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aioembed.bench.baselines import LoopbackBaseline
from aioembed.bench.command import SCHEMA, choose_baseline
from aioembed.bench.measure import WORKLOADS, BenchOptions
from aioembed.bench.workloads import ROOM_OFFSETS, room_offset
from aioembed.config import TransferConfig
from aioembed.errors import InvalidRequest

RUN = "from aioembed.cli import main; main()"


def _check_point(p: dict[str, object]) -> None:
    assert {"workload", "label", "bytes_per_sample", "samples_s", "summary", "ratio", "raw_method",
            "rounds", "zero_copy_ratio"} <= p.keys()
    samples = p["samples_s"]
    assert isinstance(samples, dict) and "raw:memmove" in samples and "raw:torch.copy_" in samples
    for xs in samples.values():
        assert isinstance(xs, list) and xs and all(isinstance(x, float) and x >= 0 for x in xs)
    summary = p["summary"]
    assert isinstance(summary, dict) and summary.keys() == samples.keys()
    for s in summary.values():
        assert {"n", "min", "median", "max", "q1", "q3", "median_mbps", "min_mbps", "max_mbps"} <= s.keys()


def test_bench_quick_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "bench", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["schema"] == SCHEMA
    assert result["mode"] == "quick" and result["transport"] == "loopback"
    assert {"cpu_count", "python", "torch", "transport", "aioembed"} <= result["machine"].keys()
    assert result["raw_baseline"]["available"] is True
    assert set(result["workloads"]) == set(WORKLOADS)
    for name in ("sizes", "concurrency", "resume", "trace"):
        w = result["workloads"][name]
        assert {"config", "points", "description"} <= w.keys()
        assert w["config"]["pool_tokens"] >= w["config"]["default_tokens"]
        assert w["points"]
        for p in w["points"]:
            _check_point(p)
    assert "two_over_one" in result["workloads"]["resume"]["summary"]
    conc = result["workloads"]["concurrency"]["points"]
    assert all({"concurrency", "transfers_per_s", "latency_p50_s", "latency_p99_s"} <= p.keys() for p in conc)
    trace = result["workloads"]["trace"]["trace"]
    assert trace["requests"] == len(trace["requests_list"])
    idle = result["workloads"]["idle"]
    assert {"cpu_s_per_s", "no_rooms", "pending_rooms", "rooms", "seconds"} <= idle.keys()
    mem = result["workloads"]["memory"]["modes"]["copy"]
    assert "error" not in mem, mem
    assert {"peak_rss_bytes", "pool_bytes", "output_bytes", "ratio", "receiver_bytes"} <= mem.keys()
    goals = result["workloads"]["goals"]
    assert [p["label"].split(":")[0] for p in goals["points"]] == ["W1", "W2", "W3", "W3"]
    w1, w2, w3one, w3many = goals["points"]
    assert set(w1["gbps"]) >= {"leased", "out", "receive"} and w1["raw_method"]
    assert set(w2["rounds_over_one"]) == {"leased", "out", "receive"}
    assert (w3one["concurrency"], w3many["concurrency"]) == (1, 32)
    assert all(v > 0 for v in w3many["req_per_s"].values())
    lines = [t["target"] for t in result["targets"]]
    assert sum(t.startswith(("W1", "W2", "W3")) for t in lines) == 15  # every goal has its line
    assert all({"threshold", "measured", "met"} <= t.keys() for t in result["targets"])
    assert "aioembed bench" in proc.stdout  # the table was printed


def test_bench_json_to_stdout_and_selection() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "bench", "--quick", "--workloads", "sizes,resume", "--sizes", "16,256",
         "--resume-tokens", "640", "--repeat", "1", "--hidden", "64", "--json", "-"],
        capture_output=True, text=True, timeout=90, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # stdout is the JSON alone: tables and progress go to stderr
    assert list(result["workloads"]) == ["sizes", "resume"]
    assert [p["tokens"] for p in result["workloads"]["sizes"]["points"]] == [16, 256]
    resume = result["workloads"]["resume"]
    assert [p["tokens"] for p in resume["points"]] == [640, 640]
    assert [p["expected_tokens"] for p in resume["points"]] == [None, 640]
    assert resume["config"]["default_tokens"] == 384 and resume["config"]["pool_tokens"] == 640
    assert [set(p["rounds"]) for p in resume["points"]] == [{2}, {1}]  # the default reservation resumes once


def test_bench_plot_without_matplotlib_is_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("rich")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("matplotlib is installed")
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "bench", "--quick", "--plot", str(tmp_path / "p.png")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2
    assert "pip install 'aioembed[plot]'" in proc.stderr


def test_bench_rejects_bad_options() -> None:
    proc = subprocess.run([sys.executable, "-c", RUN, "bench", "--workloads", "nope"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "choose from" in proc.stderr
    proc = subprocess.run([sys.executable, "-c", RUN, "bench", "--workloads", "resume", "--resume-tokens", "0"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "--resume-tokens" in proc.stderr and "must be >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-c", RUN, "bench", "--workloads", "resume", "--resume-tokens", "128"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "--resume-tokens=128 must be more than 128" in proc.stderr


@pytest.mark.parametrize(("argv", "said"), [
    (["--workloads", "stream", "--stream-tokens", "0"], "--stream-tokens must be >= 1"),
    (["--workloads", "trace", "--trace-requests", "-3"], "--trace-requests=-3 must be >= 0"),
    (["--workloads", "sizes", "--sizes", str(10**9)],
     f"--sizes: a request of {10**9} tokens is past max_request_tokens={1 << 22}"),
    (["--workloads", "resume", "--json", "/nonexistent-aioembed-dir/out.json"],
     "--json /nonexistent-aioembed-dir/out.json: no directory"),
    (["--workloads", "resume", "--plot", "/nonexistent-aioembed-dir/out.png"],
     "--plot /nonexistent-aioembed-dir/out.png: no directory"),
])
def test_bench_refuses_an_option_it_cannot_run_before_measuring(argv: list[str], said: str) -> None:
    """Each of these was taken and failed later: ``--stream-tokens 0`` as a 0-token room naming no option (after
    fencing its blocks), a negative ``--trace-requests`` and a size past ``max_request_tokens`` as tracebacks (the
    latter allocating its rows first: 7 TB here), an unwritable ``--json`` / ``--plot`` as a traceback after the
    whole run, its measurements lost."""
    pytest.importorskip("rich")
    proc = subprocess.run([sys.executable, "-c", RUN, "bench", "--quick", *argv],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "fenced" not in proc.stderr and "total time" not in proc.stdout + proc.stderr


def test_the_demo_refuses_a_width_that_is_not_positive_as_a_usage_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "aioembed", "demo", "--tokens", "64", "--hidden", "0"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "argument --hidden: expected a positive integer, got 0" in proc.stderr, proc.stderr


def test_bench_without_config_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``aioembed demo`` and the example servers do: the bench built ``TransferConfig()``, so the transport
    and options a user exported (``AIOEMBED_TRANSPORT=mooncake ...``) were ignored without a word."""
    from aioembed.bench.command import _options
    from aioembed.cli import _parser

    monkeypatch.setenv("AIOEMBED_TRANSPORT_OPTIONS", "{threads = 2}")
    monkeypatch.setenv("AIOEMBED_STAGING_TOKENS", "0")
    opts = _options(_parser().parse_args(["bench", "--quick"]))
    assert dict(opts.base_config.transport_options) == {"threads": 2}
    assert opts.base_config.staging_tokens == 0


WITHOUT_RICH = "import sys; sys.modules['rich'] = None; from aioembed.cli import main; main()"
"""The command as a plain ``pip install aioembed`` has it: without the ``cli`` extra (rich)."""


def test_the_core_install_runs_the_demo_and_names_the_extra_for_the_bench() -> None:
    demo = subprocess.run([sys.executable, "-c", WITHOUT_RICH, "demo", "--tokens", "300", "--hidden", "64"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert demo.returncode == 0, demo.stderr
    assert "bit-for-bit equal" in demo.stdout
    bench = subprocess.run([sys.executable, "-c", WITHOUT_RICH, "bench", "--quick"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert bench.returncode == 2
    assert "pip install 'aioembed[cli]'" in bench.stderr and "Traceback" not in bench.stderr


def test_the_demo_on_trio_without_trio_is_a_usage_error() -> None:
    """trio is no dependency of the core install, yet ``--backend trio`` is offered: it ended in anyio's
    ``LookupError`` traceback (exit 1) instead of a one-line usage error naming what to install."""
    without_trio = "import sys; sys.modules['trio'] = None; from aioembed.cli import main; main()"
    proc = subprocess.run([sys.executable, "-c", without_trio, "demo", "--backend", "trio", "--tokens", "300",
                           "--hidden", "64"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "--backend trio" in proc.stderr and "pip install trio" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_demo_request_past_max_request_tokens_is_refused_before_it_is_built() -> None:
    """``--tokens`` is checked against ``max_request_tokens`` before its rows are made: 10**9 tokens at the default
    width are 7 TB, and building them ended in an allocation failure's traceback (or the OOM killer)."""
    proc = subprocess.run([sys.executable, "-m", "aioembed", "demo", "--tokens", "64", str(10**9)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"--tokens {10**9}: a request is 1..{1 << 22} tokens (max_request_tokens)" in proc.stderr
    assert "Traceback" not in proc.stderr and "room demo-0" not in proc.stdout


def test_python_dash_m_aioembed_is_the_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "aioembed", "demo", "--tokens", "200", "--hidden", "64"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "room demo-0: 200 tokens" in proc.stdout


class _GpuBaseline(LoopbackBaseline):
    cuda = True


def test_a_gpu_pool_is_compared_only_with_a_baseline_that_moves_gpu_memory() -> None:
    """With the pool on a GPU the bench's sources are there too; a raw baseline that moves CPU memory only
    would time another path, so it is left out with the reason in the notes and the JSON."""
    cpu = BenchOptions(base_config=TransferConfig(transport="loopback"))
    gpu = BenchOptions(base_config=TransferConfig(transport="loopback", device="cuda:0"))

    factory, info, notes = choose_baseline(LoopbackBaseline, cpu)
    assert factory is LoopbackBaseline and info["available"] is True and info["cuda"] is False
    assert any(n.startswith("raw baseline (in this process)") for n in notes)

    factory, info, notes = choose_baseline(LoopbackBaseline, gpu)
    assert factory is None and info["available"] is False and "CPU memory only" in info["reason"]
    assert any("moves CPU memory only" in n and "cuda:0" in n for n in notes)
    assert any(n.startswith("pool on cuda:0") for n in notes)

    factory, info, notes = choose_baseline(_GpuBaseline, gpu)
    assert factory is _GpuBaseline and info["available"] is True and info["cuda"] is True
    assert any(n.startswith("raw baseline (in this process, GPU memory to GPU memory on cuda:0)") for n in notes)

    factory, info, notes = choose_baseline(None, cpu)
    assert factory is None and "reason" not in info
    assert any(n.startswith("no raw baseline for transport 'loopback'") for n in notes)


@pytest.mark.parametrize(("env", "said"), [
    ({"AIOEMBED_MAX_REQUEST_TOKENS": "256"}, "--tokens 300: a request is 1..256 tokens (max_request_tokens)"),
    ({"AIOEMBED_DEVICE": "cuda:7"}, "device='cuda:7': this process sees"),
])
def test_the_demo_reports_a_library_error_in_one_line(env: dict[str, str], said: str) -> None:
    """Errors raised inside the demo's task group came wrapped in an exception group: a 48-line traceback."""
    proc = subprocess.run([sys.executable, "-m", "aioembed", "demo", "--tokens", "300", "--hidden", "64"],
                          capture_output=True, text=True, timeout=120, check=False, env={**os.environ, **env})
    assert proc.returncode == 2, proc.stderr
    assert "aioembed: error:" in proc.stderr and said in proc.stderr and "Traceback" not in proc.stderr


def test_one_error_is_found_inside_nested_task_group_groups() -> None:
    """The demo's sender and receiver run in a task group: a library error raised there comes wrapped (nested
    groups too), and is reported in one line; anything else is not taken for it."""
    from aioembed.cli import _one_error

    error = InvalidRequest("room 'demo-0': 300 tokens; allowed 1..256 (max_request_tokens)")
    assert _one_error(BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [error])])) is error
    assert _one_error(error) is error
    assert _one_error(BaseExceptionGroup("two", [error, InvalidRequest("other")])) is None
    assert _one_error(BaseExceptionGroup("foreign", [KeyError("x")])) is None


@pytest.mark.anyio
async def test_an_unknown_receive_mode_is_refused_not_measured_as_another() -> None:
    """A misspelt mode ("leased" is a goals column, not a mode) used to run receive() into a fresh output."""
    from aioembed.bench.measure import Measurer
    from aioembed.bench.workloads import RECEIVE_MODES, check_receive_mode

    assert [check_receive_mode(m) for m in RECEIVE_MODES] == list(RECEIVE_MODES)
    base = TransferConfig(transport="loopback")
    m = Measurer(BenchOptions(base_config=base), None, lambda s: None)
    src = m.source(8 + ROOM_OFFSETS)
    async with m._session(base.replace(pool_tokens=1024, default_tokens=128)) as pair:
        with pytest.raises(ValueError, match="unknown receive mode 'leased'; known: copy, out, lease"):
            await pair.series(["r0"], src, tokens=8, expected=8, mode="leased", concurrency=1, check=None)
        with pytest.raises(ValueError, match="unknown receive mode 'leased'"):
            await pair.one("r1", src, tokens=8, expected=8, mode="leased", check=None)
        times, _ = await pair.series(["r2"], src, tokens=8, expected=8, mode="lease", concurrency=1,
                                     check=[m.opts.seed, 8 + ROOM_OFFSETS])
        assert len(times) == 1


@pytest.mark.anyio
async def test_registered_sources_send_the_goals_rows_from_the_registered_buffers() -> None:
    from aioembed.bench.measure import Measurer

    base = TransferConfig(transport="loopback")
    m = Measurer(BenchOptions(base_config=base, registered_sources=True), None, lambda s: None)
    src = m.source(64 + ROOM_OFFSETS)
    async with m._session(base.replace(pool_tokens=1024, default_tokens=128)) as pair:
        await m.register_sources(pair, src)
        sender = pair.senders[0]
        assert sender.source_buffers == 1
        staging = sender._staging
        assert staging is not None
        staged: list[int] = []
        stage = staging.stage
        staging.stage = lambda tensors, n: staged.append(n) or stage(tensors, n)  # type: ignore[method-assign]
        times, _ = await pair.series([f"r{i}" for i in range(8)], src, tokens=64, expected=64, mode="lease",
                                     concurrency=4, check=[m.opts.seed, 64 + ROOM_OFFSETS])
        assert len(times) == 8 and staged == []  # every row checked bit for bit, none staged


@pytest.mark.anyio
async def test_goals_with_registered_sources_send_every_room_from_the_registered_buffers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through run_goals itself: W1, W2 and W3 send what was registered (a workload that made its own source
    tensors would register them per send, and --registered-sources would measure nothing)."""
    from aioembed.bench.measure import Measurer
    from aioembed.session.source_buffers import SourceBufferIndex

    covered: list[bool] = []
    covering = SourceBufferIndex.covering

    def counting(self: SourceBufferIndex, tensors: Any) -> Any:
        found = covering(self, tensors)
        covered.append(found is not None)
        return found

    monkeypatch.setattr(SourceBufferIndex, "covering", counting)
    opts = BenchOptions(base_config=TransferConfig(transport="loopback"), quick=True, repeat=1, hidden=64,
                        registered_sources=True)
    result = await Measurer(opts, None, lambda s: None).run_goals()
    assert [p["label"].split(":")[0] for p in result["points"]] == ["W1", "W2", "W3", "W3"]
    assert len(covered) > 100 and all(covered), (covered.count(False), len(covered))


@pytest.mark.anyio
async def test_gc_freeze_leaves_the_session_out_of_collections_while_it_runs() -> None:
    import gc

    from aioembed.bench.measure import Measurer

    base = TransferConfig(transport="loopback")
    before = gc.get_freeze_count()
    for freeze in (False, True):
        m = Measurer(BenchOptions(base_config=base, gc_freeze=freeze), None, lambda s: None)
        src = m.source(8 + ROOM_OFFSETS)
        async with m._session(base.replace(pool_tokens=1024, default_tokens=128)) as pair:
            frozen = gc.get_freeze_count()
            # Everything alive once the session is up (the session too) is frozen, only with gc_freeze.
            assert (frozen > before) is freeze
            times, _ = await pair.series(["r0", "r1"], src, tokens=8, expected=8, mode="lease", concurrency=2,
                                         check=[m.opts.seed, 8 + ROOM_OFFSETS])
            assert len(times) == 2
        assert gc.get_freeze_count() == before  # unfrozen with the session


@pytest.mark.anyio
async def test_rooms_in_flight_receive_out_into_buffers_of_their_own() -> None:
    """W3 ``out=`` reuses buffers from room to room, but never between rooms in flight at the same time: with one
    shared buffer a room's check could read the rows another room had just copied (as a server gives each
    request in flight its own buffers)."""
    from aioembed.bench.measure import Measurer
    from aioembed.session.receiver import EmbeddingReceiver

    base = TransferConfig(transport="loopback")
    m = Measurer(BenchOptions(base_config=base), None, lambda s: None)
    src = m.source(8 + ROOM_OFFSETS)
    async with m._session(base.replace(pool_tokens=1024, default_tokens=128)) as pair:
        receiver = pair.receiver  # type: ignore[attr-defined]
        assert isinstance(receiver, EmbeddingReceiver)
        holders: dict[int, list[str]] = {}  # out buffer -> the rooms receiving into it now
        shared: list[list[str]] = []
        receive = receiver.receive

        async def recording(room: Any, **kw: Any) -> Any:
            rooms = holders.setdefault(kw["out"]["embeddings"].data_ptr(), [])
            rooms.append(room)
            if len(rooms) > 1:
                shared.append(list(rooms))
            try:
                return await receive(room, **kw)
            finally:
                rooms.remove(room)

        receiver.receive = recording  # type: ignore[method-assign]
        times, _ = await pair.series([f"r{i}" for i in range(16)], src, tokens=8, expected=8, mode="out",
                                     concurrency=4, check=[m.opts.seed, 8 + ROOM_OFFSETS])
        assert len(times) == 16 and shared == []
        assert len(pair._out) == 4  # type: ignore[attr-defined]  # one per worker, reused by its rooms


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["lease", "out"])
async def test_a_write_that_landed_nowhere_fails_the_rooms_check(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every room used to send the same rows, so a room whose write never reached the pool found the rows of the
    room before it in the same block and passed the bit-for-bit check (a bench would have timed a write that
    moved nothing). Now each room's rows are shifted by its id, and the skipped write is caught."""
    from aioembed.bench import workloads
    from aioembed.bench.measure import Measurer, PeerProcessError
    from aioembed.transports.loopback import LoopbackLink

    base = TransferConfig(transport="loopback")
    m = Measurer(BenchOptions(base_config=base), None, lambda s: None)
    src = m.source(64 + ROOM_OFFSETS)
    check = [m.opts.seed, 64 + ROOM_OFFSETS]
    assert room_offset("r0") != room_offset("r1")
    write = LoopbackLink.write
    skip = [False]

    async def maybe_nowhere(self: LoopbackLink, ops: Any) -> None:
        if not skip[0]:
            await write(self, ops)

    monkeypatch.setattr(LoopbackLink, "write", maybe_nowhere)
    for shifted in (True, False):
        if not shifted:  # as before: every room sends rows [0, 64)
            monkeypatch.setattr(workloads, "ROOM_OFFSETS", 1)
        skip[0] = False
        # A pool of one block: each room reuses the block of the room before it.
        async with m._session(base.replace(pool_tokens=128, default_tokens=128)) as pair:
            times, _ = await pair.series(["r0"], src, tokens=64, expected=64, mode=mode, concurrency=1, check=check)
            assert len(times) == 1
            skip[0] = True  # r1's write lands nowhere
            if not shifted:
                times, _ = await pair.series(["r1"], src, tokens=64, expected=64, mode=mode, concurrency=1,
                                             check=check)
                assert len(times) == 1  # the blind spot: r0's identical rows passed for r1's
                continue
            with pytest.raises(BaseExceptionGroup) as failed:
                await pair.series(["r1"], src, tokens=64, expected=64, mode=mode, concurrency=1, check=check)
            assert failed.group_contains(PeerProcessError, match="room 'r1': the rows differ from the source")


_CHECKED_WORKLOADS = ["sizes", "resume", "concurrency", "trace", "senders", "stream"]


def _only_the_first_write_lands(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on every loopback write after the first lands nowhere. Returns the count of writes (set it to 0 and
    the next one lands)."""
    from aioembed.transports.loopback import LoopbackLink

    write = LoopbackLink.write
    writes = [0]

    async def first_only(self: LoopbackLink, ops: Any) -> None:
        writes[0] += 1
        if writes[0] == 1:
            await write(self, ops)

    monkeypatch.setattr(LoopbackLink, "write", first_only)
    return writes


@pytest.mark.anyio
@pytest.mark.parametrize("workload", _CHECKED_WORKLOADS)
async def test_every_workloads_rooms_are_checked(workload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sizes and resume rooms (the NIXL plugin's 0.9 goal is read off them) were once timed and never compared
    with what was sent, and the concurrency, trace, many-senders and stream rooms were until later: writes that
    landed nowhere would have measured as fast ones. Every write after the first lands nowhere here."""
    from aioembed.bench.measure import Measurer, PeerProcessError

    opts = BenchOptions(base_config=TransferConfig(transport="loopback"), repeat=1, hidden=64, sizes=(512,),
                        resume_tokens=512, concurrency=(3,), mixes=("small",), trace_requests=6,
                        trace_concurrency=3, senders=2, senders_tokens=256, stream_tokens=3000)
    m = Measurer(opts, None, lambda s: None)
    run = getattr(m, f"run_{workload}")
    ok = await run()
    assert "checked bit for bit" in ok["description"]
    _only_the_first_write_lands(monkeypatch)
    with pytest.raises((PeerProcessError, BaseExceptionGroup)) as failed:
        await run()
    differ = "rows differ from the source"
    if isinstance(failed.value, PeerProcessError):  # a lone room (stream) fails outside any task group
        assert differ in str(failed.value)
    else:
        assert failed.group_contains(PeerProcessError, match=differ)


@pytest.mark.parametrize("mode", ["copy", "lease"])
def test_the_memory_workloads_room_is_checked(mode: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The memory child reads its peak, then compares the room's rows with the source: a write that landed
    nowhere (every write after the warm-up's here) fails the child instead of being measured as a lean one."""
    import anyio

    from aioembed.bench import memchild

    spec = {"tokens": 300, "mode": mode, "hidden": 64, "transport": "loopback"}
    assert anyio.run(memchild._run, spec)["checked"] is True
    writes = _only_the_first_write_lands(monkeypatch)
    with pytest.raises(memchild.RowsDiffer, match=f"the 300-token room's rows differ from the source \\({mode}\\)"):
        anyio.run(memchild._run, spec)
    writes[0] = 0  # the warm-up's write lands again
    with pytest.raises(SystemExit) as ended:  # the child's entry point: its last event says so, and its exit code
        memchild.main([json.dumps(spec)])
    assert ended.value.code == 3
    event = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert event["rows_differ"] is True and "rows differ from the source" in event["error"]


@pytest.mark.anyio
async def test_a_memory_room_whose_rows_differ_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that measured its peak but received the wrong rows fails the workload, naming why: its numbers are
    not recorded as an ordinary child error beside the others."""
    import anyio

    from aioembed.bench.measure import Measurer, PeerProcessError

    said = b'{"error": "the 50000-token room\'s rows differ from the source (copy)", "rows_differ": true}\n'

    async def child(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
        assert cmd[1:3] == ["-m", "aioembed.bench.memchild"]
        return subprocess.CompletedProcess(cmd, 3, said, b"")

    monkeypatch.setattr(anyio, "run_process", child)
    m = Measurer(BenchOptions(base_config=TransferConfig(transport="loopback")), None, lambda s: None)
    with pytest.raises(PeerProcessError, match=r"memory workload \(copy\): the 50000-token room's rows differ"):
        await m.run_memory()


def test_the_receiving_child_keeps_out_buffers_per_worker() -> None:
    from aioembed.bench.peer import _Checker
    from aioembed.samples import standard_layout

    out = _Checker(standard_layout(16)).out
    a, b = out.get(0, 8), out.get(1, 8)
    assert a["embeddings"].data_ptr() != b["embeddings"].data_ptr()
    assert out.get(0, 4) is a and out.get(1, 8) is b  # reused by the same worker, if large enough
    bigger = out.get(0, 16)
    assert bigger["embeddings"].shape[0] == 16 and out.get(1, 16) is not bigger and len(out) == 2


# -- refused before anything runs: transport options, drawn request sizes ---------------------------------------


def _bad_options_file(tmp_path: Path) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text('[aioembed]\ntransport = "loopback"\n\n[aioembed.transport_options]\nthreds = 2\n')
    return path


def test_the_demo_refuses_a_misspelt_transport_option_before_its_header(tmp_path: Path) -> None:
    """It was refused once the sender opened its transport, after the header was printed, and the plugin's words
    named no file."""
    path = _bad_options_file(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "aioembed", "demo", "--config", str(path), "--tokens", "64",
                           "--hidden", "64"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert ("aioembed: error: transport 'loopback' refused its transport_options: unknown loopback transport "
            "option(s) ['threds']") in proc.stderr
    assert f"(in {path})" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""  # not even the header


def test_the_bench_refuses_a_misspelt_transport_option_before_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused while the options are read (``_options``), before the progress bar: it was refused inside the first
    workload, without the variable's name."""
    from aioembed.bench.command import _options
    from aioembed.cli import _parser
    from aioembed.errors import ConfigError

    monkeypatch.setenv("AIOEMBED_TRANSPORT_OPTIONS", "{threds = 2}")
    with pytest.raises(ConfigError) as info:
        _options(_parser().parse_args(["bench", "--quick", "--workloads", "resume"]))
    assert "transport 'loopback' refused its transport_options" in str(info.value)
    assert "AIOEMBED_TRANSPORT_OPTIONS='{threds = 2}'" in str(info.value)


def test_the_bench_command_names_the_refused_options_file(tmp_path: Path) -> None:
    pytest.importorskip("rich")
    path = _bad_options_file(tmp_path)
    proc = subprocess.run([sys.executable, "-c", RUN, "bench", "--quick", "--workloads", "resume", "--config",
                           str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown loopback transport option(s) ['threds']" in proc.stderr and f"(in {path})" in proc.stderr
    assert "Traceback" not in proc.stderr and "total time" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(("argv", "said"), [
    (["--workloads", "concurrency"], "--mixes: the 'medium' mix's requests are up to 4096 tokens, past "
                                     "max_request_tokens=2048"),
    (["--workloads", "trace"], "--trace-requests: request 10 (video) of the trace of 12 requests (--seed 0) is "
                               "41261 tokens, past max_request_tokens=2048"),
    (["--workloads", "goals"], "--workloads goals: its requests are up to 20000 tokens, past max_request_tokens=2048"),
])
def test_the_bench_refuses_drawn_request_sizes_past_max_request_tokens(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], said: str) -> None:
    """As ``--sizes`` is: the concurrency mixes and the trace draw their sizes, and a room past the limit was
    refused by the receiver only once that workload ran, its source rows made for the largest first."""
    from aioembed.bench.command import _options
    from aioembed.cli import _parser
    from aioembed.errors import ConfigError

    monkeypatch.setenv("AIOEMBED_MAX_REQUEST_TOKENS", "2048")
    within = ["--sizes", "16", "--memory-tokens", "1024", "--resume-tokens", "1024", "--stream-tokens", "1024",
              "--senders-tokens", "1024"]  # every size given by a flag within the limit: only the drawn ones past it
    with pytest.raises(ConfigError) as info:
        _options(_parser().parse_args(["bench", "--quick", *within, *argv]))
    assert said in str(info.value)
    if "goals" not in argv:  # the goals' sizes are fixed: no flag brings them within the limit
        _options(_parser().parse_args(["bench", "--quick", *within, *argv, "--mixes", "small", "--trace-requests",
                                       "0"]))


def test_the_bench_checks_the_sizes_of_the_workloads_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A size for a workload left out is never sent: ``--memory-tokens`` (50000 by default) refused every run under
    ``max_request_tokens=4096``, and the trace (a video of 41261 tokens) would have too."""
    from aioembed.bench.command import _options
    from aioembed.cli import _parser

    monkeypatch.setenv("AIOEMBED_MAX_REQUEST_TOKENS", "4096")
    opts = _options(_parser().parse_args(["bench", "--quick", "--workloads", "sizes,concurrency", "--sizes",
                                          "16,1024,4096"]))
    assert opts.workloads == ("sizes", "concurrency") and max(opts.sizes) == 4096
    assert opts.base_config.max_request_tokens == 4096
