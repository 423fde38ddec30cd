"""The receiver side of the two-process benchmark mode, in a child process.

``aioembed bench`` runs the sender(s) in its own process and, for transports that cross processes
(``capabilities.cross_process``), the :class:`~aioembed.EmbeddingReceiver` here, in a child
started as ``python -m aioembed.bench.peer SPEC_JSON`` (spec: ``config``, ``hidden``,
``connect``, and ``senders``: every sender's address, for the many-senders workload). The child
talks JSON lines, like :mod:`aioembed.testing.processes`:

* stdout ``{"event": "ready", "pid": ...}`` once connected to every sender;
* stdin ``{"op": "recv", "id": i, "room": r, "expected": n | null, "mode": m, "sender": a, "check":
  [seed, top], "out_tokens": k, "at": A}``: at instant ``A`` (``time.monotonic()``, the start line where the
  parent calls ``send()``; at once if absent or passed), start the room from the sender at ``a`` (default
  ``connect``) with ``receive()`` (``mode`` copy), ``receive(out=...)`` into reused buffers of ``k`` rows,
  one set per room in flight (out) or ``receive_leased()`` (lease); the ``out=`` buffers and the reference
  rows live on the pool's device; with ``check``, the rows are compared with the rows the parent sent of the
  source it made (``room_rows(make_source(layout, top, seed), r, n)``, regenerated here on the pool's device)
  once they are in hand (``T`` taken); stdout
  ``{"event": "done", "id": i, "t0": T0, "t": T, "rounds": k}`` when the rows are in hand (``T0``: when
  the receive was called), where ``T`` is ``time.monotonic()`` at that moment (one system-wide clock on
  Linux, so the parent times the transfer from its own start to ``max(send returned, T)``); a lease is
  released after ``T`` was taken; ``{"event": "done", "id": i, "error": "..."}`` on failure (without ``hold``
  the rows are checked before that answer, and rows that differ are its error). With
  ``"hold": true`` the rows are kept (a lease unreleased) and checked only on the parent's ``check``
  command naming ``i``; that ``done`` then carries no verdict (rows that differ are reported under the
  check's id);
* stdin ``{"op": "check", "id": j, "of": i}``: check and let go of the rows that command ``i`` holds;
  stdout ``{"event": "done", "id": j, "checked": true}`` or ``{"event": "done", "id": j, "error": "..."}``;
* stdin ``{"op": "stream", "id": i, "room": r, "expected": n | null, "chunk_tokens": c, "sender": a, "at": A,
  "check": [seed, top], "out_tokens": k, "hold": h}``: at ``A``, receive the room with ``receiver.stream()``;
  stdout ``{"event": "done", "id": i, "t0": T0, "t_first": T1, "t": T, "chunks": k}`` (the first chunk in hand at
  ``T1``, the last at ``T``); its chunks' rows are checked as a ``recv``'s rows are, ``hold`` included;
* stdin ``{"op": "series", "id": i, "rooms": [...], "concurrency": c, ...}`` (the ``recv`` fields
  otherwise): receive the rooms in order, ``c`` at a time; stdout ``{"event": "done", "id": i,
  "starts": [...], "ends": [...]}``: when each room was started and in hand;
* stdin ``{"op": "exit"}`` or end of input: close the receiver and exit.

The child runs under asyncio (which every transport supports) and reads stdin through the
event loop, so a command costs no thread hand-off.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import torch

from aioembed.bench.event_channel import claim_stdout
from aioembed.bench.event_channel import emit as _emit
from aioembed.bench.start_line import reach
from aioembed.bench.workloads import (
    OutBuffers,
    check_receive_mode,
    chunk_rows,
    make_source,
    room_offset,
    rows_by_offset,
    take_room,
)
from aioembed.config import TransferConfig
from aioembed.layout import Layout
from aioembed.samples import same_rows, standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.stream import Chunk

__all__ = ["main"]


class _Checker:
    """The rows a room must hold (regenerated from the source's seed, as the sender made them), and the
    reused ``out=`` buffers (:class:`~aioembed.bench.workloads.OutBuffers`, on the pool's device); checks run
    once the child's own clock stopped (with ``hold``, the parent's too)."""

    def __init__(self, layout: Layout, device: str = "cpu") -> None:
        self.layout = layout
        self.device = device
        self._sources: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._rows: dict[tuple[int, int, int], list[dict[str, torch.Tensor]]] = {}
        self.out = OutBuffers(layout, device)

    def same(self, check: list[int] | None, rows: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
             room: str, n: int) -> bool:
        """True if ``rows`` are the ``n`` rows that ``room`` sends of the source ``check = [seed, top]``
        (:func:`~aioembed.bench.workloads.room_rows`; fewer rows are not), or nothing to check."""
        if not check:
            return True
        seed, top = int(check[0]), int(check[1])
        by_offset = self._rows.get((seed, top, n))
        if by_offset is None:
            src = self._sources.get((seed, top))
            if src is None:
                # Made on the pool's device: a GPU's rows are compared there, not copied out to CPU threads that
                # spin afterwards on the cores the next transfer needs.
                src = self._sources[seed, top] = make_source(self.layout, top, seed=seed, device=self.device)
            by_offset = self._rows[seed, top, n] = rows_by_offset(src, n)  # views: one source per (seed, top)
        return same_rows(rows, by_offset[room_offset(room)])


async def _start(cmd: dict[str, Any]) -> float:
    """When the command's receive is called: at its start line ``at`` (where the parent calls ``send()``),
    else now."""
    at = cmd.get("at")
    return await reach(float(at)) if at is not None else time.monotonic()


async def _take(receiver: EmbeddingReceiver, checker: _Checker, room: str,
                cmd: dict[str, Any], slot: int = 0) -> tuple[float, int, Callable[[], None]]:
    """One room as ``cmd`` says (``mode``: copy, out or lease; ``out`` into the buffers of worker ``slot``):
    (``time.monotonic()`` once the rows were in hand, rounds, ``finish``). ``finish()`` compares the rows with
    the source and lets them go (a lease is released); it raises if they differ."""
    mode = check_receive_mode(str(cmd.get("mode")))
    check = cmd.get("check")
    sent = int(cmd.get("out_tokens") or 0)  # the rows the parent sends (with ``check``)
    return await take_room(receiver, room, mode, expected=cmd.get("expected"), sender=cmd.get("sender"),
                           out=checker.out.get(slot, sent) if mode == "out" else None,
                           same=lambda rows: checker.same(check, rows, room, sent), clock=time.monotonic,
                           error=RuntimeError)


async def _receive(receiver: EmbeddingReceiver, checker: _Checker, room: str, cmd: dict[str, Any],
                   slot: int) -> tuple[float, int]:
    """One room of worker ``slot``, checked as soon as its rows are in hand (the sender may still be finishing);
    returns (when the rows were in hand, rounds)."""
    t, rounds, finish = await _take(receiver, checker, room, cmd, slot)
    finish()
    return t, rounds


class _Held:
    """A room kept unchecked until the parent's ``check`` command (``answer``: that command's id)."""

    def __init__(self) -> None:
        self.go = anyio.Event()
        self.answer = 0


RoomFinish = Callable[[], None]
"""Compares a room's rows with the source and lets them go; raises if they differ."""


async def _held_room(cmd: dict[str, Any], held: dict[int, _Held], hold: _Held | None,
                     take: Callable[[], Awaitable[tuple[dict[str, Any], RoomFinish]]]) -> None:
    """Command ``cmd``'s room: ``take()`` receives it and returns (what the ``done`` answer reports, its
    ``finish``). With ``hold``, its rows are kept unchecked until the parent's ``check`` command names it: the
    parent's clock stops only once its ``send()`` has returned too, and a check running before that would take the
    cores that the sender's last steps need (it reads the request twice, on a small host). Then the ``done`` of
    the command carries no verdict: the check's answer does. Without, the rows are checked before the answer."""
    cid = cmd["id"]
    try:
        try:
            answer, finish = await take()
            if hold is None:
                finish()
        except Exception as exc:
            _emit(event="done", id=cid, error=f"{type(exc).__name__}: {exc}")
            if hold is not None and hold.go.is_set():  # a check already asked about these rows
                _emit(event="done", id=hold.answer, error=f"command {cid} received no rows: {type(exc).__name__}")
            return
        _emit(event="done", id=cid, **answer)
        if hold is None:
            return
        await hold.go.wait()
        try:
            finish()
        except Exception as exc:
            _emit(event="done", id=hold.answer, error=f"{type(exc).__name__}: {exc}")
            return
        _emit(event="done", id=hold.answer, checked=True)
    finally:
        held.pop(cid, None)


async def _one(receiver: EmbeddingReceiver, checker: _Checker, cmd: dict[str, Any], held: dict[int, _Held],
               hold: _Held | None) -> None:
    """One room (``op: recv``), checked as :func:`_held_room` says."""

    async def take() -> tuple[dict[str, Any], RoomFinish]:
        t0 = await _start(cmd)  # the receive() call: a transfer starts at the first of it and send()
        t, rounds, finish = await _take(receiver, checker, cmd["room"], cmd)
        return {"t0": t0, "t": t, "rounds": rounds}, finish

    await _held_room(cmd, held, hold, take)


def _check(cmd: dict[str, Any], held: dict[int, _Held]) -> None:
    """The parent's ``check`` command: the held rows of command ``of`` may be checked and let go (once)."""
    of = cmd.get("of")
    hold = held.pop(of, None) if isinstance(of, int) else None
    if hold is None:
        _emit(event="done", id=cmd["id"], error=f"no room held for command {of!r}")
        return
    hold.answer = cmd["id"]
    hold.go.set()


async def _series(receiver: EmbeddingReceiver, checker: _Checker, cmd: dict[str, Any]) -> None:
    """Rooms ``cmd["rooms"]`` in order, ``concurrency`` at a time, each started as soon as a worker is
    free; reports when each was started and in hand (no pipe round trip inside any room's time)."""
    cid, rooms = cmd["id"], list(cmd["rooms"])
    starts: list[float] = [0.0] * len(rooms)
    ends: list[float] = [0.0] * len(rooms)
    errors: list[str] = []
    it = iter(enumerate(rooms))

    async def worker(slot: int) -> None:
        for i, room in it:
            starts[i] = time.monotonic()
            try:
                ends[i], _ = await _receive(receiver, checker, room, cmd, slot)
            except Exception as exc:
                errors.append(f"{room}: {type(exc).__name__}: {exc}")

    async with anyio.create_task_group() as tg:
        for slot in range(min(int(cmd["concurrency"]), len(rooms))):
            tg.start_soon(worker, slot)
    if errors:
        _emit(event="done", id=cid, error=f"{len(errors)} rooms failed, first: {errors[0]}")
    else:
        _emit(event="done", id=cid, starts=starts, ends=ends)


async def _stream(receiver: EmbeddingReceiver, checker: _Checker, cmd: dict[str, Any],
                  held: dict[int, _Held], hold: _Held | None) -> None:
    """One streamed room (``op: stream``, copying chunks); its chunks' rows are checked as :func:`_held_room`
    says, against the room's rows in token order."""
    room = cmd["room"]

    async def take() -> tuple[dict[str, Any], RoomFinish]:
        t0 = await _start(cmd)
        pieces: list[Chunk] = []
        t_first = 0.0
        async with receiver.stream(room, expected_tokens=cmd.get("expected"), sender=cmd.get("sender"),
                                   chunk_tokens=cmd.get("chunk_tokens")) as parts:
            async for chunk in parts:
                pieces.append(chunk)
                if len(pieces) == 1:
                    t_first = time.monotonic()
        t = time.monotonic()

        def finish() -> None:
            if not checker.same(cmd.get("check"), chunk_rows(pieces), room, int(cmd.get("out_tokens") or 0)):
                raise RuntimeError(f"room {room!r}: the streamed rows differ from the source")

        return {"t0": t0, "t": t, "t_first": t_first, "chunks": len(pieces)}, finish

    await _held_room(cmd, held, hold, take)


def _dispatch(cmd: dict[str, Any], receiver: EmbeddingReceiver, checker: _Checker, held: dict[int, _Held],
              tasks: set[asyncio.Task[None]]) -> None:
    """Start the parent's command ``cmd`` (``check`` is answered at once). A room to hold is registered here, before
    its task first runs: a ``check`` read right behind its ``recv`` (the parent letting go after a failed
    ``send()``) must find it, or a lease that then lands would be held for good."""
    op = cmd.get("op")
    if op == "check":
        _check(cmd, held)
        return
    hold = None
    if op in ("recv", "stream") and cmd.get("hold"):
        hold = held[cmd["id"]] = _Held()
    if op == "recv":
        work = _one(receiver, checker, cmd, held, hold)
    elif op == "series":
        work = _series(receiver, checker, cmd)
    elif op == "stream":
        work = _stream(receiver, checker, cmd, held, hold)
    else:
        return
    task = asyncio.create_task(work)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _run(spec: dict[str, Any]) -> None:
    layout = standard_layout(int(spec["hidden"]))
    config = TransferConfig.from_mapping(spec["config"], source="bench peer spec")
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()
    held: dict[int, _Held] = {}
    checker = _Checker(layout, config.device)
    async with EmbeddingReceiver(layout, config, connect=spec["connect"]) as receiver:
        for address in spec.get("senders") or [spec["connect"]]:
            await receiver.wait_connected(timeout=config.handshake_timeout * 3, sender=address)
        if spec.get("gc_freeze"):  # as a server does once it is up (the bench's --gc-freeze)
            gc.collect()
            gc.freeze()
        _emit(event="ready", pid=os.getpid())
        while True:
            line = await reader.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd.get("op") == "exit":
                break
            _dispatch(cmd, receiver, checker, held, tasks)
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
    claim_stdout()  # native libraries print to fd 1: keep it for the JSON lines only
    main()
