"""The plugin alone against raw NIXL: ``Link.write`` vs the bench baseline, same bytes, two processes.

``aioembed bench`` measures aioembed end to end (control messages, rounds, leases); this isolates the transport: one
``Link.write`` of rows ``[0, n)`` of every field of the standard layout into a pool in another process, against
:class:`aioembed_nixl.bench.NixlBaseline` moving the same rows, alternating, median of ``--repeat``; after each size
the owner's rows are compared with the source (a checksum; the owner then zeroes them, so the next size's writes must
land). Also the cost of registering and unregistering a request's tensors (the sender does that per request). Run
from the repository root::

    .venv/bin/python transports/nixl/tools/link_bench.py [--options '{"ucx_tls": "tcp"}']
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from aioembed.bench.baselines import destination_memory
from aioembed.config import TransferConfig
from aioembed.samples import checksum, standard_layout
from aioembed.transports.base import MemoryRegion, WriteOp
from aioembed.transports.registry import open_transport

from aioembed_nixl.bench import NixlBaseline


async def owner(options: dict[str, Any], sizes: dict[str, int]) -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # The same memory as the raw baseline's destination (huge pages, as the receive pool's large fields are): over
    # shared memory, writes into ordinary pages ran up to 1.5 times slower.
    pool = {name: destination_memory(n) for name, n in sizes.items()}
    t = await open_transport("nixl", options)
    await t.register([MemoryRegion.of_tensor(p) for p in pool.values()])
    out.write(json.dumps({"descriptor": t.descriptor().hex(),
                          "addresses": {k: p.data_ptr() for k, p in pool.items()}}) + "\n")
    out.flush()
    loop = asyncio.get_running_loop()
    while (line := await loop.run_in_executor(None, sys.stdin.readline)).strip():
        # {"rows": {field: bytes}}: the checksum of the fields' first bytes, which are then zeroed, so that a
        # later write that lands nowhere is not passed by an earlier one's bytes. Zeroed before the answer: the
        # next size's writes start once it is read, and zeroing after it raced them (CI once found 256 tokens'
        # first rows zero).
        rows = json.loads(line)["rows"]
        summed = checksum({k: pool[k][:n] for k, n in rows.items()})
        for k, n in rows.items():
            pool[k][:n].zero_()
        out.write(json.dumps(summed) + "\n")
        out.flush()
    await t.aclose()


async def main(args: argparse.Namespace) -> None:
    options = json.loads(args.options)
    layout = standard_layout(args.hidden)
    tokens = [int(x) for x in args.sizes.split(",")]
    cap = max(tokens)
    src = {n: torch.randint(0, 100, (cap, *f.shape)).to(f.dtype) for n, f in layout.items()}
    sizes = {n: cap * f.row_bytes for n, f in layout.items()}
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--owner", json.dumps([options, sizes]),
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    info = json.loads(await proc.stdout.readline())  # the owner is ready: registered and described
    raw = NixlBaseline(layout, TransferConfig(transport="nixl", transport_options=options))
    await raw.setup(src, cap)
    t = await open_transport("nixl", options)
    regions = [MemoryRegion.of_tensor(s) for s in src.values()]
    await t.register(regions)
    link = await t.connect(bytes.fromhex(info["descriptor"]))
    print(f"options {options}; {layout.bytes_per_token} bytes per token; median of {args.repeat}")
    print("| tokens | MB | raw NIXL ms (best method) | Link.write ms | Link.write / raw throughput |")
    print("|---|---|---|---|---|")
    for n in tokens:
        ops = [WriteOp(src[k].data_ptr(), info["addresses"][k], n * f.row_bytes) for k, f in layout.items()]
        await link.write(ops)
        for m in raw.methods:
            await raw.transfer(m, n)
        samples: dict[str, list[float]] = {"link": [], **{m: [] for m in raw.methods}}
        for _ in range(args.repeat):
            for m in raw.methods:
                t0 = time.perf_counter()
                await raw.transfer(m, n)
                samples[m].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await link.write(ops)
            samples["link"].append(time.perf_counter() - t0)
        want = {k: n * f.row_bytes for k, f in layout.items()}
        proc.stdin.write(json.dumps({"rows": want}).encode() + b"\n")
        await proc.stdin.drain()
        got = json.loads(await proc.stdout.readline())
        if got != checksum({k: src[k][:n] for k in layout}):
            raise SystemExit(f"{n} tokens: the owner's rows differ from the source after the writes")
        best_raw = min(statistics.median(samples[m]) for m in raw.methods)
        mine = statistics.median(samples["link"])
        print(f"| {n} | {n * layout.bytes_per_token / 1e6:.1f} | {best_raw * 1e3:.2f} | {mine * 1e3:.2f} | "
              f"{best_raw / mine:.2f} |")
    reg = []
    for _ in range(args.repeat):
        fresh = [torch.empty(cap * f.row_bytes, dtype=torch.uint8) for f in layout.values()]
        t0 = time.perf_counter()
        await t.register([MemoryRegion.of_tensor(x) for x in fresh])
        await t.unregister([MemoryRegion.of_tensor(x) for x in fresh])
        reg.append(time.perf_counter() - t0)
    print(f"register + unregister of a request's {len(layout)} tensors ({cap} tokens): "
          f"{statistics.median(reg) * 1e3:.2f} ms median")
    await link.aclose()
    await t.aclose()
    await raw.aclose()
    proc.stdin.write(b"\n")
    await proc.stdin.drain()
    await proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--options", default="{}", help="transport_options as JSON")
    parser.add_argument("--sizes", default="1024,8192,32768", help="tokens per write, comma-separated")
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--owner", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.owner:
        opts, field_sizes = json.loads(a.owner)
        asyncio.run(owner(opts, field_sizes))
    else:
        asyncio.run(main(a))
