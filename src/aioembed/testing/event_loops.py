"""The event loops aioembed runs on, as values of anyio's pytest fixture ``anyio_backend``.

aioembed is written against anyio, so it runs on asyncio, on uvloop (the loop vLLM's and SGLang's servers
run, where an embedding receiver usually lives) and on trio. uvloop differs where a transport meets the
loop: file descriptors watched through libuv rather than a selector (the control channel's edge-triggered
ZeroMQ descriptor, UCX's worker), and callbacks from other threads (NIXL's worker). So the session, fault
and conformance suites run on each::

    @pytest.fixture(params=anyio_backends())
    def anyio_backend(request: pytest.FixtureRequest) -> AnyioBackend:
        return request.param

A loop whose package is missing (uvloop on Windows) is skipped, with the reason, not dropped silently.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, TypeAlias

import pytest

if TYPE_CHECKING:
    from pytest import ParameterSet  # only the annotations use it: not imported at run time

__all__ = ["EVENT_LOOPS", "AnyioBackend", "anyio_backends", "backend_and_options", "run_on", "running_loop"]

AnyioBackend: TypeAlias = str | tuple[str, dict[str, Any]]
"""What anyio's pytest plugin takes as ``anyio_backend``: a backend name, or a name and its options."""

EVENT_LOOPS: dict[str, tuple[AnyioBackend, str]] = {
    "asyncio": ("asyncio", "asyncio"),
    "uvloop": (("asyncio", {"use_uvloop": True}), "uvloop"),
    "trio": ("trio", "trio"),
}
"""Loop name -> (the ``anyio_backend`` value that runs it, the package it needs)."""


def anyio_backends(*names: str) -> list[ParameterSet]:
    """pytest parameters for ``anyio_backend``, one per named loop (default: every loop in
    :data:`EVENT_LOOPS`), each with the loop's name as its id."""
    unknown = [n for n in names if n not in EVENT_LOOPS]
    if unknown:
        raise ValueError(f"unknown event loop(s) {unknown}; known: {sorted(EVENT_LOOPS)}")
    params = []
    for name in names or tuple(EVENT_LOOPS):
        backend, package = EVENT_LOOPS[name]
        missing = importlib.util.find_spec(package) is None
        params.append(pytest.param(backend, id=name, marks=pytest.mark.skipif(
            missing, reason=f"the {name} event loop needs the {package!r} package, which is not installed")))
    return params


def backend_and_options(backend: AnyioBackend) -> tuple[str, dict[str, Any]]:
    """``anyio_backend`` as anyio's own calls take it (``start_blocking_portal(name, options)``, ``run``)."""
    return (backend, {}) if isinstance(backend, str) else backend


def running_loop() -> str:
    """The name (in :data:`EVENT_LOOPS`) of the event loop running the caller: what a test checks a process or
    a parameter really runs, rather than trusting its options."""
    import asyncio

    import sniffio

    if sniffio.current_async_library() == "trio":
        return "trio"
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.split(".")[0] == "uvloop" else "asyncio"


def run_on(loop: str) -> tuple[str, dict[str, Any]]:
    """The ``backend`` and ``backend_options`` of ``anyio.run`` for the event loop named ``loop``."""
    if loop not in EVENT_LOOPS:
        raise ValueError(f"unknown event loop {loop!r}; known: {sorted(EVENT_LOOPS)}")
    return backend_and_options(EVENT_LOOPS[loop][0])
