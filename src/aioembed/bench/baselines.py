"""Raw baselines: the transport moving the same bytes with no aioembed on the path.

A baseline is found by transport name: ``loopback`` is built in; a plugin registers a factory
in the entry-point group :data:`ENTRY_POINT_GROUP` (see :mod:`aioembed.bench` for the protocol).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.abc
import torch

from aioembed.bench.event_channel import parse_event
from aioembed.config import TransferConfig
from aioembed.errors import ConfigError, TransportError
from aioembed.layout import Layout
from aioembed.memory.huge_pages import zeroed_memory

__all__ = [
    "ENTRY_POINT_GROUP",
    "BaselinePeer",
    "LoopbackBaseline",
    "RawBaseline",
    "RawBaselineFactory",
    "available_baselines",
    "destination_memory",
    "moves_cuda",
    "resolve_baseline",
]

ENTRY_POINT_GROUP = "aioembed.bench_baselines"


@runtime_checkable
class RawBaseline(Protocol):
    """The transport moving rows without aioembed: what aioembed is measured against.

    Life cycle: ``await setup(sources, capacity_tokens)`` once per workload, then any number
    of ``await transfer(method, num_tokens)``, then ``await aclose()``.
    """

    description: str
    """One line saying how the raw number is obtained (shown in the output)."""
    methods: tuple[str, ...]
    """Raw variants measured side by side; the fastest median counts as "raw"."""
    cross_process: bool
    """True when the destination lives in another process (as aioembed's receiver would)."""

    # Optional: ``cuda: bool = True`` on a baseline whose ``setup`` takes CUDA sources and places its
    # destination on their device (GPU to GPU). A baseline without it moves CPU memory only, and the
    # benchmark leaves it out when the pool is on a GPU rather than compare another path (see
    # :func:`moves_cuda`).

    async def setup(self, sources: Mapping[str, torch.Tensor], capacity_tokens: int) -> None:
        """Register ``sources`` (one tensor per layout field) and prepare a destination of
        ``capacity_tokens`` rows per field (preallocated and registered, as a receive pool)."""
        ...

    async def transfer(self, method: str, num_tokens: int) -> None:
        """Move rows ``[0, num_tokens)`` of every source field to the destination's rows
        ``[0, num_tokens)``; return once every byte is visible there. Timed by the caller."""
        ...

    async def aclose(self) -> None:
        """Release what ``setup`` took."""
        ...


RawBaselineFactory = Callable[[Layout, TransferConfig], RawBaseline]
"""What an entry point of :data:`ENTRY_POINT_GROUP` resolves to (a class works)."""


def moves_cuda(baseline: RawBaseline) -> bool:
    """True when ``baseline`` declares (``cuda = True``) that it moves CUDA sources to a CUDA destination."""
    return getattr(baseline, "cuda", False) is True


class LoopbackBaseline:
    """A plain memory copy of the same source tensors into a preallocated destination.

    Two methods: ``torch.copy_`` (one ``Tensor.copy_`` per field; torch may split a large
    copy across its intra-op threads) and ``memmove`` (one ``ctypes.memmove`` per field on
    the calling thread, as the loopback transport itself copies). Both run synchronously on
    the event loop thread: nothing else is running during a raw measurement.
    """

    description = "memory copy of the same source tensors into a preallocated destination (fastest of the methods)"
    methods: tuple[str, ...] = ("torch.copy_", "memmove")
    cross_process = False

    def __init__(self, layout: Layout, config: TransferConfig) -> None:
        self.layout = layout
        self.config = config
        self._src: dict[str, torch.Tensor] = {}
        self._dst: dict[str, torch.Tensor] = {}

    async def setup(self, sources: Mapping[str, torch.Tensor], capacity_tokens: int) -> None:
        self._src = {name: sources[name].contiguous() for name in self.layout}
        # zeroed, on huge pages as the receive pool's fields are (see destination_memory), every page touched
        self._dst = {
            name: f.rows_over(destination_memory(capacity_tokens * f.row_bytes), capacity_tokens)
            for name, f in self.layout.items()
        }
        await anyio.lowlevel.checkpoint()

    async def transfer(self, method: str, num_tokens: int) -> None:
        if method == "torch.copy_":
            for name, src in self._src.items():
                self._dst[name][:num_tokens].copy_(src[:num_tokens])
        elif method == "memmove":
            move = ctypes.memmove
            for name, f in self.layout.items():
                move(self._dst[name].data_ptr(), self._src[name].data_ptr(), num_tokens * f.row_bytes)
        else:
            raise ValueError(f"unknown loopback baseline method {method!r}; known: {self.methods}")
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self._src, self._dst = {}, {}
        await anyio.lowlevel.checkpoint()


def destination_memory(nbytes: int) -> torch.Tensor:
    """Zeroed CPU memory (a uint8 tensor) for a raw baseline's destination field, on huge pages at any size.

    The receive pool puts a field of 8 MiB or more on huge pages
    (:func:`~aioembed.memory.huge_pages.zeroed_memory`). Its fields are sized by ``pool_tokens``, a raw
    destination's by the largest request, so a raw field under 8 MiB can face a pool field over it. The
    raw side therefore asks for huge pages whatever its size, and never writes into slower memory than
    aioembed does (over shared memory, huge pages made writes up to 1.5 times faster)."""
    return zeroed_memory(nbytes, min_bytes=0)


class BaselinePeer:
    """The destination process of a raw baseline: ``python -m <module> SPEC_JSON``, answering JSON lines
    (one line when ready, then one per command sent on its stdin); its stderr is kept for error messages.
    Plugins' baselines use it so that every raw number is taken across two processes, as aioembed's is."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._proc: anyio.abc.Process | None = None
        self._stderr: Any = None
        self._buf = b""

    async def start(self, module: str, spec: Mapping[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """Start the process (``python -m module``); returns its first line (what it announces once ready)."""
        return await self._start(["-m", module], spec, timeout)

    async def start_file(self, path: str, spec: Mapping[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """As :meth:`start`, running the file ``path``: a script that imports neither its package nor torch."""
        return await self._start([path], spec, timeout)

    async def _start(self, what: list[str], spec: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in aclose()
        self._proc = await anyio.open_process(
            [sys.executable, *what, json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        return await self.line(timeout)

    async def line(self, timeout: float = 60.0) -> dict[str, Any]:
        """The process's next line, parsed."""
        assert self._proc is not None and self._proc.stdout is not None
        with anyio.fail_after(timeout):
            while True:
                while b"\n" not in self._buf:
                    try:
                        self._buf += await self._proc.stdout.receive()
                    except anyio.EndOfStream:
                        raise TransportError(
                            f"{self.name} baseline peer process ended: {self.stderr_tail()}") from None
                line, self._buf = self._buf.split(b"\n", 1)
                out = parse_event(line, f"{self.name} baseline peer")
                if out is not None:
                    return out

    async def ask(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """Send a command; its answer."""
        assert self._proc is not None and self._proc.stdin is not None
        await self._proc.stdin.send(json.dumps(cmd).encode() + b"\n")
        return await self.line()

    def stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return str(self._stderr.read().decode(errors="replace")[-2000:])

    async def aclose(self) -> None:
        """Ask the process to exit (``{"op": "exit"}``), kill it if it does not within 10 s."""
        with anyio.CancelScope(shield=True):
            if self._proc is not None:
                with anyio.move_on_after(10), contextlib.suppress(
                        TransportError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, TimeoutError):
                    await self.ask({"op": "exit"})
                    await self._proc.wait()
                if self._proc.returncode is None:
                    self._proc.kill()
                    await self._proc.wait()
                await self._proc.aclose()
                self._proc = None
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None


def _builtin() -> dict[str, RawBaselineFactory]:
    return {"loopback": LoopbackBaseline}


def available_baselines() -> list[str]:
    """Transport names with a raw baseline (built in or registered by a plugin)."""
    names = set(_builtin())
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def resolve_baseline(transport: str) -> RawBaselineFactory | None:
    """The raw-baseline factory for ``transport``, or ``None`` if nobody registered one."""
    builtin = _builtin()
    if transport in builtin:
        return builtin[transport]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == transport:
            try:
                factory = ep.load()
            except Exception as exc:
                raise ConfigError(f"raw baseline plugin {ep.value!r} for transport {transport!r} "
                                  f"failed to load: {exc!r}") from exc
            if not callable(factory):
                raise ConfigError(f"entry point {ep.value!r} in {ENTRY_POINT_GROUP!r} is not callable")
            return factory  # type: ignore[no-any-return]
    return None
