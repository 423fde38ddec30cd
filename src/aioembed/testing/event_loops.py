"""The event loops aioembed runs on, as values of anyio's pytest fixture ``anyio_backend``.

aioembed is written against anyio, so it runs on asyncio, on uvloop (the loop vLLM's and SGLang's servers
run, where an embedding receiver usually lives) and on trio. uvloop differs where a transport meets the
loop: file descriptors watched through libuv rather than a selector (the control channel's edge-triggered
ZeroMQ descriptor, UCX's worker), and callbacks from other threads (NIXL's worker). So the session, fault
and conformance suites run on each; a conftest names the fixture once::

    anyio_backend = anyio_backend_fixture()             # every loop
    anyio_backend = anyio_backend_fixture("asyncio", "trio")

A loop whose package is missing (uvloop on Windows) is skipped, with the reason, not dropped silently.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import pytest
import sniffio

if TYPE_CHECKING:
    from pytest import ParameterSet  # only the annotations use it: not imported at run time

__all__ = [
    "EVENT_LOOPS",
    "AnyioBackend",
    "anyio_backend_fixture",
    "anyio_backends",
    "backend_and_options",
    "run_on",
    "running_loop",
]

AnyioBackend: TypeAlias = str | tuple[str, dict[str, Any]]
"""What anyio's pytest plugin takes as ``anyio_backend``: a backend name, or a name and its options."""

EVENT_LOOPS: dict[str, tuple[AnyioBackend, str]] = {
    "asyncio": ("asyncio", "asyncio"),
    "uvloop": (("asyncio", {"use_uvloop": True}), "uvloop"),
    "trio": ("trio", "trio"),
}
"""Loop name -> (the ``anyio_backend`` value that runs it, the package it needs)."""


def _loop(name: str) -> tuple[AnyioBackend, str]:
    if name not in EVENT_LOOPS:
        raise ValueError(f"unknown event loop {name!r}; known: {sorted(EVENT_LOOPS)}")
    return EVENT_LOOPS[name]


def anyio_backends(*names: str) -> list[ParameterSet]:
    """pytest parameters for ``anyio_backend``, one per named loop (default: every loop in
    :data:`EVENT_LOOPS`), each with the loop's name as its id."""
    params = []
    for name in names or tuple(EVENT_LOOPS):
        backend, package = _loop(name)
        missing = importlib.util.find_spec(package) is None
        params.append(pytest.param(backend, id=name, marks=pytest.mark.skipif(
            missing, reason=f"the {name} event loop needs the {package!r} package, which is not installed")))
    return params


def anyio_backend_fixture(*names: str) -> Callable[[pytest.FixtureRequest], AnyioBackend]:
    """An ``anyio_backend`` fixture over the named loops (default: all), for a conftest or a test module to bind
    under that name."""

    @pytest.fixture(params=anyio_backends(*names))
    def anyio_backend(request: pytest.FixtureRequest) -> AnyioBackend:
        return request.param  # type: ignore[no-any-return]

    return anyio_backend


def backend_and_options(backend: AnyioBackend) -> tuple[str, dict[str, Any]]:
    """``anyio_backend`` as anyio's own calls take it (``start_blocking_portal(name, options)``, ``run``)."""
    return (backend, {}) if isinstance(backend, str) else backend


def running_loop() -> str:
    """The name (in :data:`EVENT_LOOPS`) of the event loop running the caller: what a test checks a process or
    a parameter really runs, rather than trusting its options."""
    if sniffio.current_async_library() == "trio":
        return "trio"
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.split(".")[0] == "uvloop" else "asyncio"


def run_on(loop: str) -> tuple[str, dict[str, Any]]:
    """The ``backend`` and ``backend_options`` of ``anyio.run`` for the event loop named ``loop``."""
    return backend_and_options(_loop(loop)[0])
