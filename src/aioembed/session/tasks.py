"""Background tasks that a sender or receiver owns, and that its ``aclose()`` can stop from any task.

The tasks run in a task group of their own, hosted by a task that ``enter()`` starts outside the
caller's task tree: a system task under trio, a loop task under asyncio (the only per-backend code,
like pyzmq's thin per-loop adapters). So no cancel scope of ours ever sits on the user's scope
stack: ``async with``, a manual ``__aenter__`` ... ``aclose()``, ``aclose()`` from a shutdown hook
in another task, or ``aclose()`` inside a ``fail_after`` all work. Each task also runs in its own
cancel scope; ``cancel_all()`` cancels them from any task, ``wait_done()`` waits for them, and
``exit()`` stops the host. The owner always cancels what it started: nothing outlives ``aclose()``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import sniffio

from aioembed.session.async_library import KnownAsyncLibrary
from aioembed.transports.boundary import stray_cancel

__all__ = ["BackgroundTasks"]


def _start_host(fn: Callable[[], Awaitable[None]]) -> Any:
    """Run ``fn`` in a task outside the current task tree; returns what keeps it referenced."""
    if sniffio.current_async_library() == "trio":
        import trio

        trio.lowlevel.spawn_system_task(fn)
        return None
    import asyncio

    async def main() -> None:
        await fn()

    return asyncio.get_running_loop().create_task(main())


class BackgroundTasks:
    """Tasks of one owner (``name`` for logs); see the module docstring."""

    def __init__(self, name: str, log: logging.Logger) -> None:
        self.name = name
        self._log = log
        self._tg: anyio.abc.TaskGroup | None = None
        self._host: Any = None
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        self._scopes: set[anyio.CancelScope] = set()
        self._count = 0
        self._done = anyio.Event()
        self._closing = False

    async def enter(self) -> None:
        """Start the host of the task group (in the owner's ``__aenter__``): tasks can be spawned once this
        returns."""
        ready = anyio.Event()

        async def host() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    ready.set()
                    await self._stop.wait()
                    tg.cancel_scope.cancel()
            except BaseException:  # nothing may escape a host task (trio would crash the whole run)
                self._log.exception("%s: the background task host failed", self.name)
            finally:
                self._tg = None
                ready.set()
                self._stopped.set()

        self._host = _start_host(host)
        await ready.wait()

    @property
    def entered(self) -> bool:
        """True from :meth:`enter` until :meth:`exit`."""
        return self._tg is not None

    async def exit(self) -> None:
        """Stop the host (from any task; idempotent): its tasks are cancelled, and this waits until they
        and the host ended."""
        self._closing = True
        if self._host is None and self._tg is None:
            return
        self._stop.set()
        with anyio.CancelScope(shield=True):
            await self._stopped.wait()
        self._host = None

    @property
    def running(self) -> int:
        """Tasks started and not yet ended."""
        return self._count

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any,
              if_skipped: Callable[[], object] | None = None) -> bool:
        """Run ``fn(*args)`` as an owned task; nothing starts once the owner is closing (then ``False``).
        ``if_skipped``: called instead of ``fn`` if it never runs (refused here, or scheduled and then
        ``cancel_all()`` came before it started), for a caller that waits for what ``fn`` would have signalled."""
        if self._tg is None or self._closing:
            self._log.debug("%s: not starting %s: closing", self.name, getattr(fn, "__name__", fn))
            if if_skipped is not None:
                if_skipped()
            return False
        self._count += 1
        if self._count == 1:
            self._done = anyio.Event()
        self._tg.start_soon(self._owned, fn, args, if_skipped)
        return True

    async def _owned(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                     if_skipped: Callable[[], object] | None = None) -> None:
        try:
            if self._closing:
                # scheduled before cancel_all() and started after it: it must not run
                if if_skipped is not None:
                    if_skipped()
                return
            with anyio.CancelScope() as scope, KnownAsyncLibrary():
                self._scopes.add(scope)
                try:
                    await fn(*args)
                except Exception:  # a bug: logged, and the owner goes on
                    self._log.exception("%s: background task %s failed", self.name, getattr(fn, "__name__", fn))
                except BaseException as exc:
                    if not stray_cancel(exc):
                        raise
                    # Not a cancel of this task (a future someone else cancelled): let through, it ended the
                    # owner's whole task group (control socket, liveness, timers), silently.
                    self._log.exception("%s: background task %s failed with a CancelledError nobody asked for",
                                        self.name, getattr(fn, "__name__", fn))
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
