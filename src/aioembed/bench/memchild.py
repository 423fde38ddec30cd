"""Child process of the ``memory`` workload: one request, peak RSS measured in a clean process.

Run as ``python -m aioembed.bench.memchild '{"tokens": 50000, "mode": "copy", ...}'``; prints one
JSON object on stdout. Steps: import everything, build the source rows (resident from here on),
read RSS; open sender and receiver (the receive pool is zero-filled, so resident), run one small
warm-up transfer; reset the kernel's peak-RSS counter where Linux allows it (``clear_refs`` 5),
then move the request and read the peak (``VmHWM``, else ``ru_maxrss``, which in this process
only grows, so it is the same peak); last, compare the rows with the source bit for bit (the child fails if
they differ).
"""

from __future__ import annotations

import inspect
import json
import os
import resource
import sys
import time
from typing import Any

import anyio

from aioembed.bench.event_channel import claim_stdout, emit
from aioembed.bench.workloads import make_source
from aioembed.config import TransferConfig
from aioembed.samples import same_rows, standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender

__all__ = ["RowsDiffer", "main"]


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _rss() -> int:
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # pragma: no cover - not Linux


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak() -> tuple[int, str]:
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024, "VmHWM"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"  # pragma: no cover


class RowsDiffer(RuntimeError):
    """The room's rows are not what was sent: reported as the child's last event (``rows_differ``), exit code 3."""


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _run(spec: dict[str, Any]) -> dict[str, Any]:
    tokens = int(spec["tokens"])
    mode = str(spec.get("mode", "copy"))
    layout = standard_layout(int(spec.get("hidden", 3584)))
    pool_tokens = max(65536, -(-tokens // 128) * 128)
    cfg = TransferConfig(transport=str(spec.get("transport", "loopback")),
                         transport_options=spec.get("transport_options") or {},
                         block_size=128, default_tokens=8192, pool_tokens=pool_tokens)
    rss_start = _rss()
    src = make_source(layout, tokens, seed=1)
    small = make_source(layout, 16, seed=2)
    rss_source = _rss()
    bpt = layout.bytes_per_token
    async with EmbeddingSender(layout, cfg) as sender, \
            EmbeddingReceiver(layout, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected()
        async with anyio.create_task_group() as tg:  # warm-up: first-use allocations of every layer
            tg.start_soon(sender.send, "warm", small)
            await receiver.receive("warm")
        rss_open = _rss()
        reset = _reset_peak()
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "big", src)
            if mode == "lease":
                recv: Any = receiver
                got: Any = await _maybe_await(recv.receive_leased("big"))
                rounds = int(getattr(got, "rounds", 0))
            else:
                got = await receiver.receive("big")
                rounds = got.rounds
        seconds = time.perf_counter() - t0
        peak, peak_source = _peak()
        if not reset:
            peak_source += " (process lifetime)"
        try:  # after the peak was read: a failed write must not be measured as a lean one
            same = same_rows(got.views if mode == "lease" else got.tensors, src)
        finally:
            if mode == "lease":
                await _maybe_await(got.release())
        del got
        if not same:
            raise RowsDiffer(f"the {tokens}-token room's rows differ from the source ({mode})")
    pool_bytes = pool_tokens * bpt
    output_bytes = tokens * bpt if mode == "copy" else 0
    receiver_bytes = peak - rss_source
    budget = pool_bytes + output_bytes
    return {
        "mode": mode,
        "tokens": tokens,
        "rounds": rounds,
        "seconds": seconds,
        "config": {"block_size": cfg.block_size, "default_tokens": cfg.default_tokens,
                   "pool_tokens": cfg.pool_tokens, "transport": cfg.transport},
        "rss_start_bytes": rss_start,
        "source_bytes": tokens * bpt,
        "rss_with_source_bytes": rss_source,
        "rss_after_open_bytes": rss_open,
        "peak_rss_bytes": peak,
        "peak_measure": peak_source,
        "peak_reset": reset,
        "pool_bytes": pool_bytes,
        "output_bytes": output_bytes,
        "receiver_bytes": receiver_bytes,
        "budget_bytes": budget,
        "overhead_bytes": receiver_bytes - budget,
        "ratio": receiver_bytes / budget,
        "checked": True,
        "pid": os.getpid(),
    }


def main(argv: list[str] | None = None) -> None:
    """Entry point: one JSON spec argument, one JSON line out."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m aioembed.bench.memchild SPEC_JSON")
    try:
        result = anyio.run(_run, json.loads(args[0]))
    except RowsDiffer as exc:
        emit(error=str(exc), rows_differ=True)
        raise SystemExit(3) from None
    emit(**result)


if __name__ == "__main__":
    claim_stdout()  # native libraries print to fd 1: keep it for the JSON lines only
    main()
