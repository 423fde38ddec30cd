"""A writer in a fresh process (the first engine of a process decides the engine's TCP timeouts): opens an
endpoint with ``transfer_timeout``, writes 64 MiB to a peer process that is stopped (SIGSTOP), and prints
one JSON line: when the write raised, when the engine ended its stuck transfers, the environment, and what a second
endpoint asking for another timeout found. Used by test_lane_timeout.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import torch
from aioembed.errors import TransportError
from aioembed.transports.base import MemoryRegion, WriteOp

from aioembed_mooncake import MooncakeTransport

sys.path.insert(0, str(Path(__file__).parent))
from procstate import wait_stopped

SIZE = 64 << 20


async def main(timeout: int, options: dict[str, object], peer: subprocess.Popen[str],
               info: dict[str, object]) -> None:
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("aioembed_mooncake").addHandler(handler)
    src = torch.full((SIZE,), 5, dtype=torch.uint8)
    out: dict[str, object] = {}
    async with await MooncakeTransport.open(options) as t:
        out["env"] = {k: os.environ.get(k) for k in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")}
        await t.register([MemoryRegion(src.data_ptr(), SIZE)])
        link = await t.connect(bytes.fromhex(str(info["descriptor"])))
        dst = int(str(info["addr"]))
        await link.write([WriteOp(src.data_ptr(), dst, 16)])
        os.kill(peer.pid, signal.SIGSTOP)
        wait_stopped(peer.pid)
        started = time.monotonic()
        try:
            await link.write([WriteOp(src.data_ptr(), dst, SIZE)])
            raise AssertionError("a 64 MiB write to a stopped peer completed")
        except TransportError as exc:
            out["raised_after"] = time.monotonic() - started
            settled = exc.settled
        assert settled is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(settled)  # sees that the endpoint polls the stuck transfers
            with anyio.move_on_after(45):
                while t._poller.pending:
                    await anyio.sleep(0.05)
            out["ended_after"] = time.monotonic() - started  # every stuck transfer has a final status
            tg.cancel_scope.cancel()  # (settled() then waits write_lifetime more: not needed here)
        async with await MooncakeTransport.open(dict(options, transfer_timeout=timeout + 4)):
            out["env_after_second"] = os.environ.get("MC_TCP_PROGRESS_TIMEOUT_SEC")
        out["warnings"] = [w for w in warnings if "TCP lanes" in w]
    print(json.dumps(out), flush=True)


def run(timeout: int) -> None:
    options: dict[str, object] = {"protocol": "tcp", "hostname": "127.0.0.1", "transfer_timeout": timeout}
    peer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("peer_proc.py")), str(SIZE),
                             json.dumps(options)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert peer.stdout is not None
        info = json.loads(peer.stdout.readline())
        anyio.run(main, timeout, options, peer, info)
    finally:
        if peer.poll() is None:
            os.kill(peer.pid, signal.SIGCONT)
            peer.kill()
        peer.wait()


if __name__ == "__main__":
    run(int(sys.argv[1]))
