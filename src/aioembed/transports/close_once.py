"""An endpoint's close, run once: what every transport's ``aclose()`` needs and each got slightly wrong.

A server's shutdown path and a signal handler (or two owners of one endpoint) may both call
``aclose()``. The first call does the work; before this, a second call made while the first was
still closing returned at once, so "``aclose()`` returned" did not mean closed: the caller went on to
free memory the endpoint still had registered, or to open a new endpoint on the same port.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

__all__ = ["CloseOnce"]


class CloseOnce:
    """Runs an endpoint's close once; every later or concurrent :meth:`run` returns only once it ended."""

    def __init__(self) -> None:
        self._ended: anyio.Event | None = None

    async def run(self, close: Callable[[], Awaitable[None]]) -> None:
        """The first call awaits ``close()`` shielded (a close cut short by a cancellation could never be
        retried: the endpoint already counts as closed); later calls wait, cancellably, until it ended
        (failed included: its error goes to the first caller only)."""
        if self._ended is not None:
            await self._ended.wait()
            return
        self._ended = anyio.Event()
        try:
            with anyio.CancelScope(shield=True):
                await close()
        finally:
            self._ended.set()
