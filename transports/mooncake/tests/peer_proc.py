"""A mooncake endpoint in its own process, for the peer-gone tests.

Prints one JSON line ``{"descriptor": hex, "addr": int, "size": int, "pid": int}`` once its
buffer is registered, then answers ``sum OFFSET LENGTH`` lines on stdin with the SHA-1 of that
part of its buffer, until ``exit`` or end of input.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import anyio
import torch
from aioembed.transports.base import MemoryRegion

from aioembed_mooncake import MooncakeTransport


async def main(size: int, options: dict[str, object]) -> None:
    buf = torch.zeros(size, dtype=torch.uint8)
    async with await MooncakeTransport.open(options) as t:
        await t.register([MemoryRegion(buf.data_ptr(), size)])
        print(json.dumps({"descriptor": t.descriptor().hex(), "addr": buf.data_ptr(), "size": size,
                          "pid": os.getpid()}), flush=True)
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            cmd = line.split()
            if not cmd or cmd[0] == "exit":
                break
            if cmd[0] == "sum":
                off, n = int(cmd[1]), int(cmd[2])
                digest = hashlib.sha1(buf[off:off + n].numpy().tobytes()).hexdigest()
                print(digest, flush=True)


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]), json.loads(sys.argv[2]))
