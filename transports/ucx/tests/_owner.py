"""A ucx endpoint in its own process that owns memory and waits: the peer of failure tests.

Prints one JSON line ``{"descriptor": hex, "address": int, "pid": int}`` once it listens,
then serves writes until killed (or frozen with SIGSTOP by the test).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


async def main() -> None:
    import numpy as np
    from aioembed.transports.base import MemoryRegion
    from aioembed.transports.registry import open_transport

    options = json.loads(sys.argv[1])
    size = int(sys.argv[2])
    buf = np.zeros(size, dtype=np.uint8)
    t = await open_transport("ucx", options)
    await t.register([MemoryRegion(buf.ctypes.data, size)])
    sys.stdout.write(json.dumps({"descriptor": t.descriptor().hex(), "address": buf.ctypes.data,
                                 "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(0.5)


asyncio.run(main())
