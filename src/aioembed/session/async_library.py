"""Telling sniffio which async library runs, so that anyio does not look it up on every call.

Every anyio call (``anyio.current_time()``, ``Event()``, ``CancelScope()``, ...) first asks sniffio which
library runs. Under ``anyio.run()`` and under trio the answer is kept in a context variable or a
thread-local. Under a plain ``asyncio.run()``, which is how uvicorn, vLLM and SGLang run, nothing keeps
it, and sniffio calls ``asyncio.current_task()`` each time: 0.5 us on this project's 2-core VM, about
40 times per room (both sides), and half the cost of a cheap anyio call such as ``current_time()``.

A room's work runs in the caller's task (``send()``, ``receive()``) and in the owner's background tasks.
Those set sniffio's context variable for their own duration, where it is unset, to what sniffio found:
the answer any later lookup in that task would give. The caller's context is left as it was once the
call returns, so nothing changes for the application's own code.

:func:`loop_caller` is the one other place that tells the loops apart: it captures the running loop so
that another thread can have it run a callback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import Token
from types import TracebackType

import sniffio

__all__ = ["KnownAsyncLibrary", "loop_caller"]


class KnownAsyncLibrary:
    """``with KnownAsyncLibrary():`` keeps sniffio's answer in its context variable for the block, if
    nothing keeps it yet. Only in a coroutine without ``yield`` (the variable is reset on exit, in the
    same task), or in a task of its own."""

    __slots__ = ("_token",)

    def __init__(self) -> None:
        self._token: Token[str | None] | None = None

    def __enter__(self) -> None:
        if sniffio.current_async_library_cvar.get() is None and sniffio.thread_local.name is None:
            self._token = sniffio.current_async_library_cvar.set(sniffio.current_async_library())

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        token, self._token = self._token, None
        if token is not None:
            # Exited in another context than entered (an async generator closed by the loop's shutdown hooks runs
            # its cleanup in a task of its own): reset() refuses, and the context it was set in is the one ending.
            with contextlib.suppress(ValueError):
                sniffio.current_async_library_cvar.reset(token)


def loop_caller() -> Callable[[Callable[[], object]], None] | None:
    """A function that has the running event loop call ``fn()`` soon, from any thread (a finalizer too: it
    only schedules); ``None`` outside an event loop. Call this on the loop's thread. Once the loop is closed,
    the function raises ``RuntimeError`` (trio: ``RunFinishedError``, a subclass)."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None
    if library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()
        return token.run_sync_soon  # runs fn in a trio task: sniffio knows the library there
    import asyncio

    loop = asyncio.get_running_loop()

    def call(fn: Callable[[], object]) -> None:
        loop.call_soon_threadsafe(_as_library, library, fn)

    return call


def _as_library(library: str, fn: Callable[[], object]) -> None:
    """Run ``fn`` with sniffio's answer set: asyncio runs a callback outside any task, where sniffio finds no
    library and anyio calls (``Event()``, ``current_time()``) would fail."""
    token = sniffio.current_async_library_cvar.set(library)
    try:
        fn()
    finally:
        sniffio.current_async_library_cvar.reset(token)
