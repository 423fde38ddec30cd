"""Run a sender or receiver in a separate process, for two-process tests of any transport.

Both sides derive each room's rows deterministically from the room id, so the receiving
process checks what arrived bit for bit without the data ever being shipped to the test.
Each process prints one JSON object per line on stdout:

* ``{"event": "ready", "address": ..., "loop": "uvloop"}`` once listening (sender) or connected (receiver),
* ``{"event": "room", "room": ..., "ok": true, "tokens": n, "rounds": r}`` per room, or
  ``{"event": "room", "room": ..., "ok": false, "error": "...", "kind": "TransferTimeout"}``,
* ``{"event": "done", "pool_free": bool, "stats": {...}}`` at the end.

Run as ``python -m aioembed.testing.processes send|receive --spec JSON``; from a test, use
:func:`spawn` and :class:`ProcessSide`.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import torch

from aioembed.bench.event_channel import claim_stdout
from aioembed.bench.event_channel import emit as _emit
from aioembed.config import TransferConfig
from aioembed.errors import AioembedError
from aioembed.layout import Layout
from aioembed.samples import checksum, deterministic_request, standard_layout
from aioembed.session.assembly import Part
from aioembed.session.handle import Received
from aioembed.testing.event_loops import run_on, running_loop

__all__ = [
    "ProcessSide",
    "RoomSpec",
    "SideSpec",
    "checksum",
    "deterministic_request",
    "loop_stops",
    "room_source",
    "side_logs",
    "spawn",
    "standard_layout",
]


@dataclass
class RoomSpec:
    """One room of a multi-process run.

    ``tokens`` is always the whole room's length: both sides derive the same rows from the room id.
    A sender sends the whole room, or with ``part`` set, rows ``[start, end)`` as that part. A
    receiver takes it from ``sender`` (default: its side's ``connect``), or assembles it from
    ``parts``, each ``[sender address, start, end]``.
    """

    room: int | str
    tokens: int
    expected_tokens: int | None = None
    sender: str = ""
    parts: list[list[Any]] = field(default_factory=list)
    part: int | None = None
    start: int = 0
    end: int | None = None


@dataclass
class SideSpec:
    """Everything one process needs: its role, the config, the layout size and its rooms."""

    role: str  # "send" or "receive"
    config: dict[str, Any]
    rooms: list[RoomSpec]
    hidden: int = 256
    bind: str = "tcp://127.0.0.1:0"
    connect: str = ""
    rank: int = 0
    world: int = 1
    concurrency: int = 64
    linger: float = 0.0
    """Seconds to stay up after the last room (so a peer can finish)."""
    settle: float = 10.0
    """Receiver: at most this long after the last room, wait for fenced blocks to come back."""
    wait_for_receivers: int = 0
    """Sender: send nothing until this many receivers hold a session (start-up is never raced)."""
    backend: str = "asyncio"
    """The side's event loop: ``asyncio``, ``uvloop`` or ``trio`` (:data:`.event_loops.EVENT_LOOPS`)."""
    env: dict[str, str] = field(default_factory=dict)
    netns: str = ""
    """Run the side in this network namespace (``ip netns exec``; needs root), e.g. behind a link a test cuts."""

    def to_json(self) -> str:
        d = dict(self.__dict__)
        d["rooms"] = [r.__dict__ for r in self.rooms]
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> SideSpec:
        d = json.loads(text)
        d["rooms"] = [RoomSpec(**r) for r in d["rooms"]]
        return cls(**d)


_EVENT_START = b'{"event": '
"""How every line :func:`_emit` writes starts (``event`` is its first key)."""


LOOP_WATCHDOG_SECONDS = 3.0
"""A side whose event loop stops this long writes every thread's stack to its stderr (kept for the test)."""


async def _run_side(spec: SideSpec) -> None:
    """The side's role, watched: :func:`faulthandler.dump_traceback_later` runs in a thread of its own that
    needs neither the loop nor the GIL, so a loop stopped by a native call holding the GIL is caught too
    (a receiver rank of a UCX test fell silent past 5 s that way, cause unknown)."""

    async def rearm() -> None:
        while True:
            faulthandler.dump_traceback_later(LOOP_WATCHDOG_SECONDS, file=sys.stderr)
            await anyio.sleep(1.0)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rearm)
            await _run_role(spec)
            tg.cancel_scope.cancel()
    finally:
        faulthandler.cancel_dump_traceback_later()


async def _run_role(spec: SideSpec) -> None:
    from aioembed.session.receiver import EmbeddingReceiver
    from aioembed.session.sender import EmbeddingSender

    # A slow start-up on purpose (e.g. torch + CUDA + a native engine take 5-6 s on a GPU host).
    await anyio.sleep(float(os.environ.get("AIOEMBED_TEST_START_DELAY", "0")))
    # A loop blocked on purpose (a long synchronous call), for the watchdog's own test.
    time.sleep(float(os.environ.get("AIOEMBED_TEST_BLOCK_LOOP", "0")))  # noqa: ASYNC251 (on purpose)
    layout = standard_layout(spec.hidden)
    config = TransferConfig.from_mapping(spec.config, source="spec")
    limiter = anyio.Semaphore(spec.concurrency)
    results: dict[str, int] = {"ok": 0, "failed": 0}
    # Deriving and checking rows (tens of ms each for large rooms) runs in one worker thread: on the
    # loop, a burst of rooms ending together held it for 0.5 s on an idle 2-core host (longer under
    # load), and the side's heartbeats waited that long.
    checker = anyio.CapacityLimiter(1)

    def report(room: RoomSpec, ok: bool, **extra: Any) -> None:
        results["ok" if ok else "failed"] += 1
        _emit(event="room", room=room.room, ok=ok, **extra)

    if spec.role == "send":
        async with EmbeddingSender(layout, config, bind=spec.bind) as sender:
            _emit(event="ready", address=sender.address, pid=os.getpid(), loop=running_loop())
            if spec.wait_for_receivers:
                await sender.wait_for_receivers(spec.wait_for_receivers, timeout=300)

            async def send_one(room: RoomSpec) -> None:
                async with limiter:
                    data, meta = await anyio.to_thread.run_sync(room_source, layout, room, limiter=checker)
                    try:
                        await sender.send(room.room, data, meta, part=room.part)
                    except AioembedError as exc:
                        report(room, False, error=str(exc), kind=type(exc).__name__, part=room.part)
                    else:
                        report(room, True, tokens=int(next(iter(data.values())).shape[0]), part=room.part)

            async with anyio.create_task_group() as tg:
                for room in spec.rooms:
                    tg.start_soon(send_one, room)
            await anyio.sleep(spec.linger)
            _emit(event="done", pool_free=sender.rooms_in_flight == 0, stats=results)
    elif spec.role == "receive":
        async with EmbeddingReceiver(layout, config, connect=spec.connect or None, rank=spec.rank,
                                     world=spec.world) as receiver:
            named = {r.sender for r in spec.rooms if r.sender} | {str(p[0]) for r in spec.rooms for p in r.parts}
            for address in sorted(named | ({spec.connect} if spec.connect else set())):
                await receiver.wait_connected(timeout=config.handshake_timeout * 3, sender=address)
            _emit(event="ready", address=spec.connect, pid=os.getpid(), loop=running_loop())

            async def receive_one(room: RoomSpec) -> None:
                parts = [Part(str(a), int(b), int(e)) for a, b, e in room.parts] or None
                async with limiter:
                    try:
                        got = await receiver.receive(room.room, expected_tokens=room.expected_tokens,
                                                     sender=room.sender or None, parts=parts)
                    except AioembedError as exc:
                        report(room, False, error=str(exc), kind=type(exc).__name__)
                        return
                    problem = await anyio.to_thread.run_sync(_check_received, layout, room, got, parts,
                                                             limiter=checker)
                    report(room, problem is None, tokens=got.num_tokens, rounds=got.rounds, error=problem)

            async with anyio.create_task_group() as tg:
                for room in spec.rooms:
                    tg.start_soon(receive_one, room)
            await anyio.sleep(spec.linger)
            # Blocks a failed sender may still write stay fenced until a proof (or, for a sender
            # whose process ended, its transport's orphan lifetime) releases them: wait for that.
            with anyio.move_on_after(spec.settle):
                await receiver.allocator.wait_all_free()
            st = receiver.allocator.stats
            _emit(event="done", pool_free=st.free == st.total and receiver.rooms_in_flight == 0,
                  stats=dict(results, free=st.free, total=st.total, fenced=st.fenced))
    else:
        raise SystemExit(f"unknown role {spec.role!r}")


def room_source(layout: Layout, room: RoomSpec) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The rows a sender sends for ``room`` (its part only, if it sends one) and their metadata."""
    data = deterministic_request(layout, room.tokens, room.room)
    if room.part is not None:
        data = {n: t[room.start:room.end].contiguous() for n, t in data.items()}
    return data, {"tokens": room.tokens, "sum": checksum(data)}


def _check_received(layout: Layout, room: RoomSpec, got: Received, parts: list[Part] | None) -> str | None:
    """What differs between ``got`` and the rows both sides derive from the room id (``None``: nothing)."""
    want = deterministic_request(layout, room.tokens, room.room)
    if got.num_tokens != room.tokens:
        return f"{got.num_tokens} tokens arrived, {room.tokens} were sent"
    if not all(torch.equal(got.tensors[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want):
        return "data differ from the source"
    if parts is None:
        return None if got.metadata.get("sum") == checksum(want) else "metadata differ from the source"
    for i, p in enumerate(parts):
        rows = {n: t[p.start:p.end] for n, t in want.items()}
        if got.part_metadata[i].get("sum") != checksum(rows):
            return f"metadata of part {i} differ from the source"
    return None


class ProcessSide:
    """A running side process; read its JSON events with :meth:`next_event`."""

    def __init__(self, process: anyio.abc.Process, stderr_path: str | None = None, name: str = "side",
                 backend: str = "asyncio") -> None:
        self.process = process
        self.name = name
        self.backend = backend
        """The event loop the side was asked to run (:attr:`SideSpec.backend`); :meth:`ready` checks it."""
        self.events: list[dict[str, Any]] = []
        self.other_output: list[str] = []
        """Lines on stdout that are not events (what a native library wrote there before the process claimed
        its stdout; afterwards such output is in its stderr)."""
        self._buffer = b""
        self._stderr_path = stderr_path

    def stderr_tail(self, lines: int | None = 30) -> str:
        """The last ``lines`` lines (``None``: all) the process wrote to stderr (its warnings, with times),
        for a failing test's message: what the side saw is otherwise lost with the process."""
        if self.other_output:
            shown = self.other_output[-lines:] if lines is not None else self.other_output
            noise = "(stdout, not events:)\n" + "\n".join(shown) + "\n"
        else:
            noise = ""
        if self._stderr_path is None:
            return noise + "(stderr not captured)"
        try:
            with open(self._stderr_path, errors="replace") as f:
                return noise + "".join(f.readlines()[-lines:] if lines is not None else f.readlines())
        except OSError as exc:
            return f"{noise}(stderr unreadable: {exc})"

    @property
    def pid(self) -> int:
        return self.process.pid

    async def next_event(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next JSON event printed by the process (raises ``TimeoutError`` or ``EOFError``). Other lines
        (written before the process claimed its stdout for its events) are kept in :attr:`other_output` and
        skipped."""
        assert self.process.stdout is not None
        with anyio.fail_after(timeout):
            while True:
                while b"\n" not in self._buffer:
                    try:
                        chunk = await self.process.stdout.receive()
                    except anyio.EndOfStream:
                        raise EOFError(f"process {self.pid} ended (code {self.process.returncode})") from None
                    self._buffer += chunk
                line, self._buffer = self._buffer.split(b"\n", 1)
                # An event is one JSON object that starts with its "event" key (see _emit). A native library's
                # unterminated output may precede it on the same line, and its own lines may start with "{".
                start = line.find(_EVENT_START)
                if start >= 0:
                    try:
                        event = json.loads(line[start:])
                    except ValueError:
                        event = None
                    if isinstance(event, dict):
                        if start:
                            self.other_output.append(line[:start].decode(errors="replace"))
                        break
                self.other_output.append(line.decode(errors="replace"))
        self.events.append(event)
        return event

    async def until(self, kind: str, timeout: float = 60.0) -> dict[str, Any]:
        """Skip to the next event of ``kind``."""
        with anyio.fail_after(timeout):
            while True:
                ev = await self.next_event(timeout)
                if ev.get("event") == kind:
                    return ev

    async def ready(self, timeout: float = 60.0, *, also: Sequence[ProcessSide] = ()) -> dict[str, Any]:
        """The side's ``ready`` event, once it runs the event loop it was asked for. A side that ends or stays
        silent first fails the test with its stderr and that of the sides in ``also`` (what they saw is
        otherwise lost with the processes)."""
        try:
            ev = await self.until("ready", timeout=timeout)
        except (EOFError, TimeoutError) as exc:
            raise AssertionError(f"{self.name} did not start: {exc}\n{side_logs(self, *also, lines=40)}") from exc
        assert ev.get("loop") == self.backend, (f"{self.name} (pid {ev.get('pid')}) was asked to run {self.backend} "
                                                f"and runs {ev.get('loop')}")
        return ev

    async def rooms(self, count: int, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Collect ``count`` room results."""
        out: list[dict[str, Any]] = []
        with anyio.fail_after(timeout):
            while len(out) < count:
                ev = await self.next_event(timeout)
                if ev.get("event") == "room":
                    out.append(ev)
        return out

    def kill(self) -> None:
        """SIGKILL the process."""
        self.process.kill()


def _titled(side: ProcessSide, tail: str) -> str:
    return f"--- {side.name} (pid {side.pid}) stderr:\n{tail}"


def side_logs(*sides: ProcessSide, lines: int = 30) -> str:
    """The stderr tails of ``sides``, each under its name: for the message of a failing assertion."""
    return "\n".join(_titled(side, side.stderr_tail(lines)) for side in sides)


def loop_stops(*sides: ProcessSide) -> str:
    """The stderr of each side whose event loop stopped for :data:`LOOP_WATCHDOG_SECONDS` or more (its
    threads' stacks, from the watchdog); empty if none did. For a passing test to report as a warning."""
    tails = ((side, side.stderr_tail(None)) for side in sides)  # all of it: a dump may precede many lines
    return "\n".join(_titled(side, tail) for side, tail in tails if "Timeout (" in tail)


async def _open_process(cmd: Sequence[str], env: dict[str, str], stderr: Any) -> anyio.abc.Process:
    """``anyio.open_process`` with no garbage collection across the fork. uvloop's spawn runs Python's after-fork
    hooks in the child (CPython's own spawn does not), and a collection there, in a copy of a process whose native
    engines have threads of their own, crashed the child before its exec (SIGSEGV "Garbage-collecting" in
    ``threading._after_fork``, once in a CI run of the restart suite on uvloop). The child inherits the disabled
    collector and execs at once."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return await anyio.open_process(cmd, env=env, stderr=stderr)
    finally:
        if enabled:
            gc.enable()


@asynccontextmanager
async def spawn(spec: SideSpec) -> AsyncIterator[ProcessSide]:
    """Start a side in a new Python process; killed on exit if still running."""
    env = dict(os.environ)
    env.update(spec.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd: Sequence[str] = [sys.executable, "-m", "aioembed.testing.processes", "--spec", spec.to_json()]
    if spec.netns:
        cmd = ["ip", "netns", "exec", spec.netns, *cmd]  # execs the command: the side keeps this pid
    passthrough = bool(spec.env.get("AIOEMBED_TEST_STDERR"))
    with (contextlib.nullcontext() if passthrough
          else tempfile.NamedTemporaryFile(prefix="aioembed-side-", suffix=".stderr")) as err:
        process = await _open_process(cmd, env, err)
        side = ProcessSide(process, None if err is None else err.name, name=f"{spec.role}[{spec.rank}]",
                           backend=spec.backend)
        try:
            yield side
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                # Bounded: a child that is already reaped (or a lost SIGCHLD) must not hang the test run.
                with anyio.move_on_after(10) as scope:
                    await process.wait()
                    await process.aclose()
                if scope.cancelled_caught:
                    warnings.warn(f"side process {process.pid} did not report its exit within 10 s after kill",
                                  RuntimeWarning, stacklevel=2)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry: run one side described by ``--spec``."""
    parser = argparse.ArgumentParser(prog="python -m aioembed.testing.processes")
    parser.add_argument("--spec", required=True, help="SideSpec as JSON")
    args = parser.parse_args(argv)
    spec = SideSpec.from_json(args.spec)
    # A native crash (SIGSEGV in an engine) writes every thread's stack to the kept stderr: a side that died with
    # code -11 before its ready line left an empty stderr, and nothing to go on.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # AIOEMBED_TEST_LOG_LEVEL (e.g. DEBUG): a side's log at that level, for a failure that needs its steps.
    logging.basicConfig(level=os.environ.get("AIOEMBED_TEST_LOG_LEVEL", "WARNING").upper(), stream=sys.stderr,
                        format=f"%(asctime)s {spec.role}[{spec.rank}] %(name)s %(levelname)s %(message)s")
    try:
        backend, options = run_on(spec.backend)
    except ValueError as exc:
        raise SystemExit(f"backend={spec.backend!r}: {exc}") from None
    anyio.run(_run_side, spec, backend=backend, backend_options=options)


if __name__ == "__main__":
    claim_stdout()  # native libraries print to fd 1: keep it for the JSON lines only
    main()
