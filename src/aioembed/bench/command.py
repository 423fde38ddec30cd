"""``aioembed bench``: options, the run, and its output (progress bar, tables, JSON, plot)."""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import anyio

from aioembed.bench.baselines import (
    ENTRY_POINT_GROUP,
    RawBaselineFactory,
    available_baselines,
    moves_cuda,
    resolve_baseline,
)
from aioembed.bench.event_channel import claimed_stdout
from aioembed.bench.goals import W1_TOKENS, W2_TOKENS, W3_TOKENS
from aioembed.bench.measure import WORKLOADS, BenchOptions, Measurer, has_zero_copy, plan_steps
from aioembed.bench.targets import evaluate_targets
from aioembed.bench.workloads import (
    FULL_CONCURRENCY,
    FULL_SIZES,
    QUICK_CONCURRENCY,
    QUICK_SIZES,
    REQUEST_MIXES,
    generate_trace,
)
from aioembed.config import TransferConfig
from aioembed.errors import ConfigError
from aioembed.samples import standard_layout
from aioembed.transports.registry import check_transport_options

__all__ = ["CLI_HINT", "SCHEMA", "add_arguments", "choose_baseline", "run"]

SCHEMA = "aioembed-bench/1"
CLI_HINT = "aioembed bench shows its tables with rich, an optional extra: pip install 'aioembed[cli]'"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _name_list(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x for x in text.replace(" ", "").split(",") if x)
        bad = [n for n in names if n not in choices]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(choices)}")
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` subcommand's options to ``parser``."""
    parser.description = (
        "Measure aioembed end to end (copying receive(), zero-copy receive_leased() where available) side by "
        "side with the transport's raw baseline on the same bytes, alternating runs; report medians, spreads "
        "and the ratio aioembed / raw."
    )
    parser.add_argument("--transport", default=None,
                        help="transport to measure (default: from --config, else AIOEMBED_TRANSPORT, else loopback)")
    parser.add_argument("--config", default=None,
                        help="TOML config file for the transport and its options (pool sizes are set per workload; "
                             "default: AIOEMBED_* environment variables)")
    parser.add_argument("--quick", action="store_true",
                        help="few sizes and repetitions: finishes in well under a minute (for CI)")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write every raw sample and summary as JSON to FILE ('-' for stdout)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="plot throughput vs size (needs matplotlib: pip install 'aioembed[plot]')")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed repetitions per point and variant (default 7, quick 3; small points x4)")
    parser.add_argument("--sizes", type=_int_list, default=None,
                        help=f"request sizes in tokens, comma-separated (default {','.join(map(str, FULL_SIZES))}; "
                             f"quick {','.join(map(str, QUICK_SIZES))})")
    parser.add_argument("--concurrency", type=_int_list, default=None,
                        help=f"rooms in flight, comma-separated (default {','.join(map(str, FULL_CONCURRENCY))}; "
                             f"quick {','.join(map(str, QUICK_CONCURRENCY))})")
    parser.add_argument("--mixes", type=_name_list(tuple(REQUEST_MIXES)), default=None,
                        help="request mixes of the concurrency workload (default small,medium)")
    parser.add_argument("--workloads", type=_name_list(WORKLOADS), default=None,
                        help=f"workloads to run, comma-separated (default all: {','.join(WORKLOADS)})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the trace and request-size generators")
    parser.add_argument("--hidden", type=int, default=3584, help="embedding width in bf16 values (default 3584)")
    parser.add_argument("--trace-requests", type=int, default=None,
                        help="requests in the mixed trace (default 100, quick 12)")
    parser.add_argument("--trace-concurrency", type=int, default=4, help="rooms in flight replaying the trace")
    parser.add_argument("--idle-seconds", type=float, default=None,
                        help="seconds of each idle CPU measurement (default 10, quick 1.5)")
    parser.add_argument("--idle-rooms", type=int, default=1000, help="pending rooms of the idle workload")
    parser.add_argument("--memory-tokens", type=int, default=50000, help="request size of the memory workload")
    parser.add_argument("--resume-tokens", type=int, default=16384,
                        help="request size of the resume workload (default 16384; more than 128): N//2 rounded up "
                             "to 128-token blocks is the default reservation (two rounds), against the whole length "
                             "as expected_tokens (one round, as the raw baseline's one write of known size)")
    parser.add_argument("--stream-tokens", type=int, default=None,
                        help="request size of the streaming workload (default 100000, quick 20000)")
    parser.add_argument("--senders", type=int, default=4, help="encoders of the many-senders workload (default 4)")
    parser.add_argument("--senders-tokens", type=int, default=4096,
                        help="tokens per room of the many-senders workload (default 4096)")
    parser.add_argument("--process-model", choices=("auto", "one", "two"), default="auto",
                        help="'two': the receiver in a child process, the sender (and the raw baseline's source) "
                             "here; 'one': both in this process; auto (default): two where the transport crosses "
                             "processes (every plugin transport), one for loopback")
    parser.add_argument("--registered-sources", action="store_true",
                        help="goals, sizes: register the source tensors once with the sender (register_sources(), "
                             "as an encoder with long-lived output buffers does), so send() neither stages nor "
                             "registers per request (where the transport reads unregistered CPU sources, e.g. "
                             "Mooncake over TCP, send() does neither anyway); the raw baseline's sources are "
                             "registered once either way")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="both processes call gc.collect(); gc.freeze() once each workload's sender and "
                             "receiver are up, as vLLM and SGLang servers do after start-up, so full collections "
                             "scan only the objects made since (docs/performance-history.md: 'Garbage collection "
                             "under load')")
    parser.add_argument("--control-floor", action="store_true",
                        help="sizes: also time each raw method framed by the two control messages of aioembed's "
                             "protocol (a request, then done: plain pyzmq to and from a bare peer process); the "
                             "'floor' column (raw / floor) is the ratio to raw of a transfer that moved the data "
                             "as the raw method does and spent nothing else: a reference for aioembed's own cost")


def _options(args: argparse.Namespace) -> BenchOptions:
    # Without --config, the AIOEMBED_* environment, as `aioembed demo` and the example servers read it: the bench
    # ignored it, so `AIOEMBED_TRANSPORT=mooncake aioembed bench` measured loopback without a word.
    base = TransferConfig.from_toml(args.config) if args.config else TransferConfig.from_env()
    if args.transport:
        base = base.replace(transport=args.transport)
    # Before anything is measured (and before the progress bar): the transport checked its options only when the
    # first workload opened it. An unknown transport is refused here too.
    check_transport_options(base)
    quick = bool(args.quick)
    repeat = args.repeat if args.repeat is not None else (3 if quick else 7)
    if repeat < 1:
        raise ConfigError(f"--repeat={repeat} must be >= 1")
    # ``--stream-tokens 0`` is a value given, not the default: it ran, and failed inside the workload as a room of
    # 0 tokens that named no option (after fencing the room's blocks).
    if min(args.hidden, args.idle_rooms, args.memory_tokens, args.resume_tokens, args.trace_concurrency,
           args.senders, args.senders_tokens, 1 if args.stream_tokens is None else args.stream_tokens) < 1:
        raise ConfigError("--hidden, --idle-rooms, --memory-tokens, --resume-tokens, --trace-concurrency, "
                          "--senders, --senders-tokens and --stream-tokens must be >= 1")
    if args.trace_requests is not None and args.trace_requests < 0:  # a ValueError's traceback from the trace
        raise ConfigError(f"--trace-requests={args.trace_requests} must be >= 0")
    workloads = args.workloads or WORKLOADS
    _check_request_sizes(args, quick, workloads, base.max_request_tokens)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        # Checked before the run, which takes minutes: the write at its end raised a traceback and lost every
        # measurement.
        if path is not None and path != "-":
            _check_writable(flag, path)
    if args.resume_tokens <= 128:
        raise ConfigError(f"--resume-tokens={args.resume_tokens} must be more than 128: the resume workload reserves "
                          "N//2 tokens rounded up to 128-token blocks first, which must be less than the request")
    idle_s = args.idle_seconds if args.idle_seconds is not None else (1.5 if quick else 10.0)
    if not (idle_s > 0 and math.isfinite(idle_s)):
        raise ConfigError(f"--idle-seconds={idle_s} must be > 0")
    if args.control_floor and "sizes" not in workloads:
        raise ConfigError("--control-floor frames the raw transfers of the sizes workload; add sizes to --workloads")
    return BenchOptions(
        base_config=base,
        quick=quick,
        repeat=repeat,
        sizes=args.sizes or (QUICK_SIZES if quick else FULL_SIZES),
        concurrency=args.concurrency or (QUICK_CONCURRENCY if quick else FULL_CONCURRENCY),
        mixes=args.mixes or tuple(REQUEST_MIXES),
        workloads=workloads,
        seed=args.seed,
        hidden=args.hidden,
        trace_requests=_trace_requests(args, quick),
        trace_concurrency=args.trace_concurrency,
        idle_rooms=args.idle_rooms,
        idle_seconds=idle_s,
        memory_tokens=args.memory_tokens,
        resume_tokens=args.resume_tokens,
        senders=args.senders,
        senders_tokens=args.senders_tokens,
        stream_tokens=_stream_tokens(args, quick),
        process_model=_process_model(args.process_model, base.transport),
        registered_sources=bool(args.registered_sources),
        gc_freeze=bool(args.gc_freeze),
        control_floor=bool(args.control_floor),
    )


def _stream_tokens(args: argparse.Namespace, quick: bool) -> int:
    """The streaming workload's request size: ``--stream-tokens``, else 20000 (quick) or 100000."""
    return int(args.stream_tokens) if args.stream_tokens is not None else (20000 if quick else 100000)


def _trace_requests(args: argparse.Namespace, quick: bool) -> int:
    """The mixed trace's length: ``--trace-requests``, else 12 (quick) or 100."""
    return int(args.trace_requests) if args.trace_requests is not None else (12 if quick else 100)


def _check_request_sizes(args: argparse.Namespace, quick: bool, workloads: tuple[str, ...], limit: int) -> None:
    """Refuse a request size past ``max_request_tokens`` before its rows are made: its source tensors came first,
    and a typo's (``--sizes 5000000`` at the default width is 35 GB) ended in an allocation failure's traceback,
    or in the OOM killer, instead of the room's refusal. Only the workloads that run are looked at: a size for
    one left out of ``--workloads`` is never sent (``--memory-tokens`` at its default of 50000 refused a
    ``--workloads sizes`` run under ``max_request_tokens=32768``)."""
    sizes = {"--sizes": ("sizes", max(args.sizes or (QUICK_SIZES if quick else FULL_SIZES))),
             "--memory-tokens": ("memory", args.memory_tokens), "--resume-tokens": ("resume", args.resume_tokens),
             "--stream-tokens": ("stream", _stream_tokens(args, quick)),
             "--senders-tokens": ("senders", args.senders_tokens)}
    for flag, (workload, tokens) in sizes.items():
        if workload in workloads and tokens > limit:
            raise ConfigError(f"{flag}: a request of {tokens} tokens is past max_request_tokens={limit}, the largest "
                              "a receiver accepts (raise max_request_tokens to measure larger ones, or lower "
                              f"{flag})")
    goals_top = max(W1_TOKENS, W2_TOKENS, W3_TOKENS)  # the goals' sizes are fixed (the targets are set at them)
    if "goals" in workloads and goals_top > limit:
        raise ConfigError(f"--workloads goals: its requests are up to {goals_top} tokens, past max_request_tokens="
                          f"{limit}, the largest a receiver accepts (raise max_request_tokens, or leave goals out of "
                          "--workloads)")
    # The concurrency and trace workloads draw their sizes: each was refused only by the receiver, room by room,
    # once the workload ran (after the progress bar and every workload before it), its source rows made for the
    # largest. Their largest is known here: a mix's upper bound, and the seeded trace's largest request.
    if "concurrency" in workloads:
        for mix in args.mixes or tuple(REQUEST_MIXES):
            top = REQUEST_MIXES[mix][1]
            if top > limit:
                raise ConfigError(f"--mixes: the {mix!r} mix's requests are up to {top} tokens, past "
                                  f"max_request_tokens={limit}, the largest a receiver accepts (raise "
                                  f"max_request_tokens, or leave {mix!r} out of --mixes)")
    if "trace" in workloads:
        requests = _trace_requests(args, quick)
        top_request = max(generate_trace(requests, seed=args.seed), key=lambda r: r.tokens, default=None)
        if top_request is not None and top_request.tokens > limit:
            raise ConfigError(f"--trace-requests: request {top_request.index} ({top_request.kind}) of the trace of "
                              f"{requests} requests (--seed {args.seed}) is {top_request.tokens} tokens, past "
                              f"max_request_tokens={limit}, the largest a receiver accepts (raise "
                              "max_request_tokens, draw another trace with --seed or fewer --trace-requests, or "
                              "leave trace out of --workloads)")


def _check_writable(flag: str, path: str) -> None:
    """Refuse an output file that cannot be written, before anything is measured."""
    p = Path(path)
    folder = p.parent
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; expected a file name")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: no directory {str(folder)!r} to write it in")
    if not os.access(p if p.exists() else folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: not writable here")


def _process_model(choice: str, transport: str) -> str:
    from aioembed.transports.registry import resolve_transport

    cross = resolve_transport(transport).capabilities.cross_process
    if choice == "two" and not cross:
        raise ConfigError(f"--process-model two: transport {transport!r} cannot cross processes")
    if choice == "auto":
        return "two" if cross else "one"
    return choice


def choose_baseline(factory: RawBaselineFactory | None,
                    opts: BenchOptions) -> tuple[RawBaselineFactory | None, dict[str, Any], list[str]]:
    """The raw baseline to measure against (or none), its JSON record and the notes to print. With the pool
    on a GPU the sources are there too, and a baseline that moves CPU memory only is left out: its ratio
    would compare another path."""
    cfg, notes = opts.base_config, []
    on_gpu = cfg.device.startswith("cuda")
    info: dict[str, Any] = {"available": False, "entry_point_group": ENTRY_POINT_GROUP}
    if on_gpu:
        notes.append(f"pool on {cfg.device}: the sources are made there too, so aioembed moves GPU memory to GPU "
                     "memory")
    if factory is None:
        notes.append(f"no raw baseline for transport {opts.transport!r}: a plugin adds one in the entry-point group "
                     f"{ENTRY_POINT_GROUP!r}; raw and ratio columns are empty")
        return None, info, notes
    b = factory(standard_layout(opts.hidden), cfg)
    cuda = moves_cuda(b)
    if on_gpu and not cuda:
        notes.append(f"the raw baseline of {opts.transport!r} moves CPU memory only; with the pool on {cfg.device} "
                     "it would measure another path, so raw and ratio columns are empty")
        return None, dict(info, reason="moves CPU memory only; the pool is on a GPU"), notes
    info.update(available=True, description=b.description, methods=list(b.methods), cross_process=b.cross_process,
                cuda=cuda)
    where = "destination in another process" if b.cross_process else "in this process"
    gpu = f", GPU memory to GPU memory on {cfg.device}" if on_gpu else ""
    notes.append(f"raw baseline ({where}{gpu}): {b.description}")
    return factory, info, notes


def _machine(transport: str, device: str = "cpu") -> dict[str, Any]:
    import torch

    import aioembed
    from aioembed.transports.registry import available_transports

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 0
    gpu = None
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(torch.device(device))
    return {
        "gpu": gpu,
        "torch_cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "aioembed": aioembed.__version__,
        "transport": transport,
        "transports_installed": available_transports(),
        "raw_baselines_installed": available_baselines(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


class _Progress:
    """rich progress bar; paused (no refresh thread) during CPU-time measurements."""

    def __init__(self, total: int, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._p = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), console=console, refresh_per_second=4)
        self._task = self._p.add_task("starting", total=total)
        self._paused = False

    def __enter__(self) -> _Progress:
        self._p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._p.stop()

    def tick(self, description: str) -> None:
        if description:
            self._p.update(self._task, description=description)
            if description.startswith("idle"):
                self._p.stop()  # the idle workload measures this process's CPU: no refresh thread
                self._p.console.print(f"{description} (progress display paused while measuring CPU time)")
                self._paused = True
        else:
            if self._paused:
                self._paused = False
                self._p.start()
            self._p.advance(self._task)


def run(args: argparse.Namespace) -> int:
    """Run ``aioembed bench``; returns the exit code. With ``--json -`` stdout carries the JSON report alone:
    what a native library prints there meanwhile (UCX logs its warnings to stdout) goes to stderr."""
    if args.json == "-":
        with claimed_stdout() as out:
            return _run(args, out)
    return _run(args, sys.stdout)


def _run(args: argparse.Namespace, stdout: TextIO) -> int:
    if importlib.util.find_spec("rich") is None:
        print(f"aioembed bench: error: {CLI_HINT}", file=sys.stderr)
        return 2
    from rich.console import Console

    from aioembed.bench.report import PLOT_HINT, render, write_plot

    opts = _options(args)
    to_stdout = args.json == "-"
    console = Console(stderr=to_stdout)
    if not console.is_terminal:
        console = Console(stderr=to_stdout, width=200)  # logs and CI: do not wrap the tables at 80 columns
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(f"aioembed bench: error: {PLOT_HINT}", file=sys.stderr)
        return 2
    if opts.process_model == "two":
        process_note = (
            "process model 'two': sender here, receiver (EmbeddingReceiver) in a child process "
            "(python -m aioembed.bench.peer), started per workload; a transfer is timed from the first of the "
            "calls send() here and receive() in the child until send() has returned and the child has the rows "
            "(time.monotonic in both processes; the command's trip through the pipe to the child is not "
            "counted); workloads idle and memory still run both sides in one process"
        )
    else:
        process_note = ("process model 'one': sender and receiver run in this process"
                        + (" (loopback cannot cross processes)" if opts.transport == "loopback" else
                           " (--process-model one)"))
    notes: list[str] = [
        process_note,
        "variants of a point run interleaved after one untimed warm-up each, in a carry-over-balanced order (a "
        "Williams design: within each cycle of N or 2N repetitions for N variants, each runs in each position and "
        "right after every other one equally often); spread = [min-max] of the timed repetitions",
        "aioembed MB/s = request bytes / (time from receiver start() + sender send() until both return, the rows "
        "in a freshly allocated output); ratio = aioembed median MB/s / raw median MB/s",
        "the copying receive() moves every byte twice (transport write into the pool, copy-out into the output) "
        "where the raw baseline moves it once",
    ]
    if opts.registered_sources:
        notes.append("sources: the source tensors (goals, sizes) are registered once with the sender "
                     "(register_sources()): send() writes from them without staging or registering per request")
    if opts.gc_freeze:
        notes.append("gc: both aioembed processes froze their heap (gc.collect(); gc.freeze()) once each workload's "
                     "sender and receiver were up, as vLLM and SGLang servers do after start-up; the raw baseline's "
                     "own peer process did not")
    if opts.control_floor:
        notes.append("floor = raw / (the raw transfer framed by a request from a bare peer process and a 'done' "
                     "back to it, plain pyzmq over TCP loopback, timed in the peer), same raw method: what a transfer "
                     "of aioembed's protocol shape would reach if it moved the data as the raw method does and spent "
                     "nothing else; a reference, not a bound (a faster data path passes it; near 1 it is noise)")
    factory, baseline_info, baseline_notes = choose_baseline(resolve_baseline(opts.transport), opts)
    if opts.control_floor and not baseline_info.get("cross_process"):
        why = baseline_info.get("reason") or ("one in this process" if baseline_info["available"] else "none")
        raise ConfigError(f"--control-floor needs a raw baseline that crosses processes; transport "
                          f"{opts.transport!r} has {why}")
    notes.extend(baseline_notes)
    zero_copy = has_zero_copy()
    if not zero_copy:
        notes.append("zero-copy column omitted: this aioembed's EmbeddingReceiver has no receive_leased()")
    machine = _machine(opts.transport, opts.base_config.device)
    started = time.time()
    t0 = time.perf_counter()
    workloads: dict[str, Any] = {}

    with _Progress(plan_steps(opts), console) as progress:
        measurer = Measurer(opts, factory, progress.tick)

        async def main() -> None:
            runners = {
                "sizes": measurer.run_sizes, "concurrency": measurer.run_concurrency,
                "resume": measurer.run_resume, "trace": measurer.run_trace, "senders": measurer.run_senders,
                "stream": measurer.run_stream, "goals": measurer.run_goals,
                "idle": measurer.run_idle, "memory": measurer.run_memory,
            }
            for w in opts.workloads:
                w0 = time.perf_counter()
                workloads[w] = await runners[w]()
                workloads[w]["duration_s"] = time.perf_counter() - w0

        anyio.run(main)

    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "started_at": _dt.datetime.fromtimestamp(started, _dt.UTC).isoformat(),
        "duration_s": time.perf_counter() - t0,
        "command": ["aioembed", *sys.argv[1:]] if sys.argv and sys.argv[0] else None,
        "mode": "quick" if opts.quick else "full",
        "transport": opts.transport,
        "machine": machine,
        "settings": {
            "repeat": opts.repeat, "sizes": list(opts.sizes), "concurrency": list(opts.concurrency),
            "mixes": list(opts.mixes), "workloads": list(opts.workloads), "seed": opts.seed,
            "hidden": opts.hidden, "bytes_per_token": measurer.layout.bytes_per_token,
            "trace_requests": opts.trace_requests, "trace_concurrency": opts.trace_concurrency,
            "idle_rooms": opts.idle_rooms, "idle_seconds": opts.idle_seconds, "memory_tokens": opts.memory_tokens,
        },
        "process_model": opts.process_model,
        "registered_sources": opts.registered_sources,
        "gc_freeze": opts.gc_freeze,
        "control_floor": opts.control_floor,
        "raw_baseline": baseline_info,
        "zero_copy": {"available": zero_copy},
        "workloads": workloads,
        "targets": evaluate_targets(workloads),
        "notes": notes,
    }
    render(result, console)
    console.print(f"total time {result['duration_s']:.1f} s", highlight=False)
    if args.json:
        text = json.dumps(_finite(result), indent=1, allow_nan=False, default=str)
        if to_stdout:
            stdout.write(text + "\n")
            stdout.flush()
        else:
            Path(args.json).write_text(text + "\n")
            console.print(f"JSON written to {args.json}", highlight=False)
    if args.plot:
        write_plot(result, args.plot)
        console.print(f"plot written to {args.plot}", highlight=False)
    return 0


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (strict JSON has no inf/nan)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
