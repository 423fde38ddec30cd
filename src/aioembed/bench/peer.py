"""The receiver side of the two-process benchmark mode, in a child process.

``aioembed bench`` runs the sender(s) in its own process and, for transports that cross processes
(``capabilities.cross_process``), the :class:`~aioembed.EmbeddingReceiver` here, in a child
started as ``python -m aioembed.bench.peer SPEC_JSON`` (spec: ``config``, ``hidden``,
``connect``, and ``senders``: every sender's address, for the many-senders workload). The child
talks JSON lines, like :mod:`aioembed.testing.processes`:

* stdout ``{"event": "ready", "pid": ...}`` once connected to every sender;
* stdin ``{"op": "recv", "id": i, "room": r, "expected": n | null, "lease": bool, "sender": a}``:
  start the room from the sender at ``a`` (default ``connect``) with ``receive()``, or
  ``receive_leased()`` when ``lease``; stdout
  ``{"event": "done", "id": i, "t": T, "rounds": k}`` when the rows are in hand, where ``T`` is
  ``time.monotonic()`` at that moment (one system-wide clock on Linux, so the parent times the
  transfer from its own start to ``max(send returned, T)``); a lease is released after ``T``
  was taken; ``{"event": "done", "id": i, "error": "..."}`` on failure;
* stdin ``{"op": "stream", "id": i, "room": r, "expected": n | null, "chunk_tokens": c, "sender": a}``:
  receive the room with ``receiver.stream()``; stdout ``{"event": "done", "id": i, "t_first": T1,
  "t": T, "chunks": k}`` (the first chunk in hand at ``T1``, the last at ``T``);
* stdin ``{"op": "exit"}`` or end of input: close the receiver and exit.

The child runs under asyncio (which every transport supports) and reads stdin through the
event loop, so a command costs no thread hand-off.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from aioembed.config import TransferConfig
from aioembed.samples import standard_layout
from aioembed.session.receiver import EmbeddingReceiver

__all__ = ["main"]


def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def _one(receiver: EmbeddingReceiver, cmd: dict[str, Any]) -> None:
    cid = cmd["id"]
    try:
        expected = cmd.get("expected")
        sender = cmd.get("sender")
        if cmd.get("lease"):
            lease = await receiver.receive_leased(cmd["room"], expected_tokens=expected, sender=sender)
            t = time.monotonic()
            rounds = lease.rounds
            lease.release()
        else:
            got = await receiver.receive(cmd["room"], expected_tokens=expected, sender=sender)
            t = time.monotonic()
            rounds = got.rounds
            del got
    except Exception as exc:
        _emit(event="done", id=cid, error=f"{type(exc).__name__}: {exc}")
        return
    _emit(event="done", id=cid, t=t, rounds=rounds)


async def _stream(receiver: EmbeddingReceiver, cmd: dict[str, Any]) -> None:
    cid = cmd["id"]
    chunks, t_first = 0, 0.0
    try:
        async with receiver.stream(cmd["room"], expected_tokens=cmd.get("expected"), sender=cmd.get("sender"),
                                   chunk_tokens=cmd.get("chunk_tokens")) as parts:
            async for _chunk in parts:
                chunks += 1
                if chunks == 1:
                    t_first = time.monotonic()
        t = time.monotonic()
    except Exception as exc:
        _emit(event="done", id=cid, error=f"{type(exc).__name__}: {exc}")
        return
    _emit(event="done", id=cid, t=t, t_first=t_first, chunks=chunks)


async def _run(spec: dict[str, Any]) -> None:
    layout = standard_layout(int(spec["hidden"]))
    config = TransferConfig.from_mapping(spec["config"], source="bench peer spec")
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()
    async with EmbeddingReceiver(layout, config, connect=spec["connect"]) as receiver:
        for address in spec.get("senders") or [spec["connect"]]:
            await receiver.wait_connected(timeout=config.handshake_timeout * 3, sender=address)
        _emit(event="ready", pid=os.getpid())
        while True:
            line = await reader.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd.get("op") == "exit":
                break
            if cmd.get("op") in ("recv", "stream"):
                task = asyncio.create_task(_one(receiver, cmd) if cmd["op"] == "recv" else _stream(receiver, cmd))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point: one JSON spec argument."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m aioembed.bench.peer SPEC_JSON")
    asyncio.run(_run(json.loads(args[0])))


if __name__ == "__main__":
    main()
