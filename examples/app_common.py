"""Plumbing shared by the example servers: config loading, serving an app, clean shutdown.

Kept apart so the two servers show only what is specific to aioembed. Two things here matter
for a real deployment:

* uvicorn is run *inside* our own event loop (``serving``), so the app's HTTP server, the
  aioembed sender or receiver and their background tasks share one loop and shut down in order;
* SIGINT / SIGTERM are handled by us, not by uvicorn (whose handler re-raises the signal after
  shutdown and ends in a ``KeyboardInterrupt`` traceback): a signal sets an event, the program
  lets the requests in flight finish (for a bounded time), HTTP serving stops, then the
  receiver/sender close, and the process exits 0 (see ``StopSignal``). A second signal ends that
  wait at once: what is still in flight is aborted (on both sides) and the program closes in order.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import uvicorn
from starlette.types import ASGIApp

from aioembed import TransferConfig
from aioembed.transports import check_transport_options

__all__ = ["LOG_LEVELS", "StopSignal", "describe", "load_config", "port_number", "run_main", "serving", "wait_any"]

log = logging.getLogger("examples")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""``--log-level`` choices (the names logging and uvicorn both take)."""


def port_number(text: str) -> int:
    """``argparse`` type of a TCP port: a bad ``--port`` is a usage error, not a traceback at bind time."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0..65535; 0: any free port)")
    return port


def load_config(path: str | Path | None) -> TransferConfig:
    """``--config FILE`` wins; otherwise the ``AIOEMBED_*`` environment (loopback when unset). The transport checks
    its options here, at start-up (it opens nothing): a misspelt one is refused naming the file or variables before
    the model is built, not when the sender or receiver opens."""
    config = TransferConfig.from_toml(path) if path else TransferConfig.from_env()
    check_transport_options(config)
    return config


def describe(config: TransferConfig) -> str:
    """One line naming the transport and the reservation sizes, for startup logs."""
    opts = dict(config.transport_options)
    return (f"transport={config.transport}{' ' + str(opts) if opts else ''}, "
            f"default_tokens={config.default_tokens}, pool_tokens={config.pool_tokens}, "
            f"block_size={config.block_size}")


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the program (see the module docstring)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@asynccontextmanager
async def serving(app: ASGIApp, host: str, port: int, *, log_level: str = "warning",
                  graceful_timeout: int = 10) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0 picks a free port) while the block runs; yields the URL.

    Leaving the block, also by cancellation, stops the server gracefully: it stops accepting,
    lets requests in flight finish (at most ``graceful_timeout`` seconds), then runs the app's
    lifespan shutdown. The server runs shielded so that a cancel cannot skip those steps.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=graceful_timeout, access_log=False)
    server = _Server(config)
    ended = anyio.Event()
    failure: list[str] = []

    async def run() -> None:
        with anyio.CancelScope(shield=True):
            try:
                await server.serve()
            except SystemExit as exc:  # uvicorn exits when it cannot bind or the lifespan fails
                failure.append(f"HTTP server on {host}:{port} did not start (exit code {exc.code})")
            finally:
                ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while not server.started:
            if ended.is_set():
                raise RuntimeError(failure[0] if failure else f"HTTP server on {host}:{port} stopped at startup")
            await anyio.sleep(0.01)
        bound_host, bound_port = server.servers[0].sockets[0].getsockname()[:2]
        try:
            yield f"http://{bound_host}:{bound_port}"
        finally:
            server.should_exit = True


async def wait_any(*events: anyio.Event) -> None:
    """Return once any of ``events`` is set."""
    async with anyio.create_task_group() as tg:
        async def one(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(one, event)


class StopSignal:
    """What SIGINT / SIGTERM do: ask a serving program to stop, or abort one still starting up.

    Stopping by *cancellation* would also cancel the sender's or receiver's own background tasks
    at once, so transfers in flight would fail instead of finishing. Once the program serves
    (``await stop.wait()``), the first signal therefore only sets an event and the program
    winds down in order, letting requests in flight finish for a bounded time. The second sets
    :attr:`hurry`: the services stop waiting and abort what is in flight at once, and the program
    still closes in order (the drains run shielded, so a cancel would not shorten them). A third
    signal, or one during startup, cancels everything.
    """

    def __init__(self, scope: anyio.CancelScope) -> None:
        self._scope = scope
        self._event = anyio.Event()
        self._serving = False
        self.hurry = anyio.Event()
        """Set by the second signal: a drain aborts the requests in flight without waiting for them."""

    async def wait(self) -> None:
        """Serve until a signal asks to stop."""
        self._serving = True
        await self._event.wait()

    def trigger(self) -> None:
        """Called on each signal."""
        if self._serving and not self._event.is_set():
            self._event.set()
        elif self._serving and not self.hurry.is_set():
            self.hurry.set()
        else:
            self._scope.cancel()


def run_main(name: str, main: Callable[[StopSignal], Awaitable[int]]) -> int:
    """Run ``main`` on asyncio until it returns; SIGINT/SIGTERM go to its ``StopSignal``.

    Returns ``main``'s exit code (0 when a signal cancelled it during startup).
    """
    code = 0

    async def wrapper() -> None:
        nonlocal code
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with anyio.create_task_group() as tg:
                stop = StopSignal(tg.cancel_scope)

                async def watch() -> None:
                    async for signum in signals:
                        print(f"{name}: {signal.Signals(signum).name} received, shutting down",
                              file=sys.stderr, flush=True)
                        stop.trigger()

                tg.start_soon(watch)
                code = await main(stop)
                tg.cancel_scope.cancel()

    try:
        anyio.run(wrapper, backend="asyncio")  # uvicorn (and the ucx transport) need asyncio
    except BaseExceptionGroup as group:
        raise _single(group) from None
    return code


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one error inside nested task-group wrappers, so callers can ``except`` it plainly."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for e in exc.exceptions:
                walk(e)
        else:
            leaves.append(exc)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group
