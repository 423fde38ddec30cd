"""A NIXL endpoint in its own process that owns memory and waits: the peer of the failure tests.

Prints one JSON line ``{"descriptor": hex, "address": int, "pid": int}`` once its memory is registered
(the test waits for it: start-up is never raced), then answers ``sum`` (non-zero bytes of the buffer),
``unregister`` and ``exit`` on stdin until killed (or frozen with SIGSTOP by the test). Native
libraries print to file descriptor 1, so the JSON lines go to a duplicate of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def emit(**event: object) -> None:
    OUT.write(json.dumps(event) + "\n")
    OUT.flush()


async def main() -> None:
    import torch
    from aioembed.transports.base import MemoryRegion
    from aioembed.transports.registry import open_transport

    options = json.loads(sys.argv[1])
    size = int(sys.argv[2])
    buf = torch.zeros(size, dtype=torch.uint8)
    region = MemoryRegion.of_tensor(buf)
    t = await open_transport("nixl", options)
    await t.register([region])
    emit(descriptor=t.descriptor().hex(), address=buf.data_ptr(), pid=os.getpid())
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        if cmd["op"] == "sum":
            emit(nonzero=int(torch.count_nonzero(buf)))
        elif cmd["op"] == "zero":
            buf.zero_()
            emit(ok=True)
        elif cmd["op"] == "unregister":
            await t.unregister([region])
            emit(ok=True)
        elif cmd["op"] == "exit":
            break
    await t.aclose()


asyncio.run(main())
