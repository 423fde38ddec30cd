"""Background tasks that a sender or receiver owns, and that its ``aclose()`` can stop from any task.

The tasks run in a task group entered by ``__aenter__`` (the only way to start tasks under both
asyncio and trio), but each inside its own cancel scope: cancelling the group's scope would also
cancel the body of the user's ``async with``, and only the entering task may exit the group. So
``cancel_all()`` cancels the tasks' own scopes, from any task, and ``wait_done()`` waits for them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc

__all__ = ["BackgroundTasks"]


class BackgroundTasks:
    """Tasks of one owner (``name`` for logs); see the module docstring."""

    def __init__(self, name: str, log: logging.Logger) -> None:
        self.name = name
        self._log = log
        self._tg: anyio.abc.TaskGroup | None = None
        self._scopes: set[anyio.CancelScope] = set()
        self._count = 0
        self._done = anyio.Event()
        self._closing = False

    def attach(self, tg: anyio.abc.TaskGroup) -> None:
        """Start tasks in ``tg`` from now on."""
        self._tg = tg

    @property
    def running(self) -> int:
        """Tasks started and not yet ended."""
        return self._count

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` as an owned task; nothing starts once the owner is closing."""
        if self._tg is None or self._closing:
            self._log.debug("%s: not starting %s: closing", self.name, getattr(fn, "__name__", fn))
            return
        self._count += 1
        if self._count == 1:
            self._done = anyio.Event()
        self._tg.start_soon(self._owned, fn, args)

    async def _owned(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            if self._closing:
                return  # scheduled before cancel_all() and started after it: it must not run
            with anyio.CancelScope() as scope:
                self._scopes.add(scope)
                try:
                    await fn(*args)
                except Exception:  # a bug: logged, and the owner goes on
                    self._log.exception("%s: background task %s failed", self.name, getattr(fn, "__name__", fn))
                finally:
                    self._scopes.discard(scope)
        finally:
            self._count -= 1
            if self._count == 0:
                self._done.set()

    def cancel_all(self) -> None:
        """Stop every task (from any task); no new one starts after this."""
        self._closing = True
        for scope in list(self._scopes):
            scope.cancel()

    async def wait_done(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until every task ended; logs the ones that did not."""
        if self._count:
            with anyio.move_on_after(timeout):
                await self._done.wait()
        if self._count:
            self._log.error("%s: %d background tasks did not end when cancelled", self.name, self._count)
