"""Waking the event loop from the endpoint's NIXL thread, without blocking that thread.

``anyio.from_thread.run_sync`` waits for the loop to run the call, which would stall every transfer
of the endpoint while the loop is busy; a completion only needs to *schedule* ``Event.set`` on the
loop. That is ``loop.call_soon_threadsafe`` under asyncio and ``TrioToken.run_sync_soon`` under trio:
two thin adapters, as pyzmq's ``_future`` has per loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import sniffio
from aioembed.errors import ConfigError

__all__ = ["LoopWaker"]


class LoopWaker:
    """Schedules callbacks on the event loop that created it, from any thread."""

    def __init__(self) -> None:
        try:
            lib = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            lib = "none"
        self.library = lib
        self._closed: tuple[type[BaseException], ...]
        if lib == "asyncio":
            loop = asyncio.get_running_loop()
            self._soon: Callable[[Callable[[], Any]], Any] = loop.call_soon_threadsafe
            self._closed = (RuntimeError,)  # the loop is closed
        elif lib == "trio":
            import trio

            self._soon = trio.lowlevel.current_trio_token().run_sync_soon
            self._closed = (trio.RunFinishedError,)
        else:
            raise ConfigError(f"transport 'nixl' runs under asyncio or trio, not {lib!r}")

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on the loop thread soon; dropped if the loop has ended."""
        with contextlib.suppress(*self._closed):
            self._soon(fn)
