"""The session <-> plugin boundary: whatever a plugin raises becomes a ``TransportError``.

Native engines (Mooncake, ucxx, NIXL) raise what they like: ``RuntimeError``, ``ValueError``,
``OSError``, their own exception types. The sessions call plugins only through
:class:`GuardedTransport` and :class:`GuardedLink`, so every failure reaches them as a
:class:`~aioembed.errors.TransportError` with the original exception as ``__cause__``, and a
write that failed in a way the plugin did not explain counts as one that may still land
(``may_land=True``): its blocks are fenced, never reused on a guess.

``ConfigError`` and ``TransportError`` pass through unchanged; cancellation and other
``BaseException`` s (``KeyboardInterrupt``) are never swallowed. An ``asyncio.CancelledError`` that is not
a cancellation of the calling task (a plugin awaiting one of its own futures that it, or its engine's close,
cancelled; or any under trio) is a plugin failure like any other: let through, anyio's task groups would
drop it silently, and a round written chunk by chunk counted as landed.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NoReturn

from aioembed.errors import AioembedError, ConfigError, TransportError
from aioembed.log_budget import WarningBudget
from aioembed.transports.base import Link, MemoryRegion, Transport, WriteOp

__all__ = ["GuardedLink", "GuardedTransport", "foreign_error", "guard", "open_guarded", "stray_cancel"]

log = logging.getLogger("aioembed.transports")


def foreign_error(plugin: str, call: str, exc: BaseException, *, may_land: bool | None = None) -> TransportError:
    """A ``TransportError`` for an exception a plugin raised in ``call`` (the cause is kept)."""
    err = TransportError(f"transport {plugin!r}: {call} raised {type(exc).__name__}: {exc}", may_land=may_land)
    err.__cause__ = exc
    return err


def stray_cancel(exc: BaseException) -> bool:
    """True if ``exc`` is an ``asyncio.CancelledError`` that does not cancel the running task: nobody asked to
    cancel it (asyncio's ``Task.cancelling()``, which anyio's cancel scopes and ``Task.cancel()`` raise), or it
    runs under another event loop (trio). A real cancellation is never taken for one."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop here (trio): nothing of ours raises asyncio's cancellation
        return True
    return task is not None and task.cancelling() == 0


_PLUGIN_ERRORS = (Exception, asyncio.CancelledError)
"""What the guards catch: every plugin failure, and a CancelledError to tell apart (:func:`stray_cancel`)."""


def _reraise(plugin: str, call: str, exc: BaseException, *, may_land: bool | None = None) -> NoReturn:
    if not isinstance(exc, Exception) and not stray_cancel(exc):
        raise exc  # a real cancellation: the caller's
    if isinstance(exc, TransportError) and exc.settled is not None:
        exc.settled = _guarded_settled(plugin, call, exc.settled)
    if isinstance(exc, (TransportError, ConfigError)):
        raise exc
    if isinstance(exc, AioembedError):  # another error of ours from inside a plugin: still a transport failure
        raise TransportError(f"transport {plugin!r}: {call} failed: {exc}", may_land=may_land) from exc
    raise foreign_error(plugin, call, exc, may_land=may_land) from exc


def _guarded_settled(plugin: str, call: str,
                     settled: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """A failed write's ``settled`` (the plugin's own coroutine function, awaited by a sender's background task)
    behind the boundary too: a stray cancel out of it cancelled every background task of the sender."""
    if getattr(settled, "_guarded", False):
        return settled

    async def guarded() -> None:
        try:
            await settled()
        except _PLUGIN_ERRORS as exc:
            _reraise(plugin, f"settled() of a failed {call}", exc)

    guarded._guarded = True  # type: ignore[attr-defined]
    return guarded


async def open_guarded(cls: type[Transport], options: Mapping[str, Any]) -> GuardedTransport:
    """Open ``cls`` through the boundary."""
    try:
        inner = await cls.open(options)
    except _PLUGIN_ERRORS as exc:
        _reraise(getattr(cls, "name", cls.__name__), "open()", exc)
    try:
        return GuardedTransport(inner)
    except TransportError:
        try:  # the endpoint it opened is nobody's: closed here, not left registered with its engine
            await inner.aclose()
        except _PLUGIN_ERRORS as exc:
            if not isinstance(exc, Exception) and not stray_cancel(exc):
                raise
            log.warning("transport %r: closing an endpoint it could not describe: %s: %s",
                        getattr(cls, "name", cls.__name__), type(exc).__name__, exc)
        raise


def guard(transport: Transport) -> GuardedTransport:
    """``transport`` behind the boundary (itself if it already is)."""
    return transport if isinstance(transport, GuardedTransport) else GuardedTransport(transport)


class GuardedLink(Link):
    """A plugin's link, with every exception mapped to ``TransportError``."""

    def __init__(self, inner: Link, plugin: str) -> None:
        self.inner = inner
        self._plugin = plugin

    @property
    def peer(self) -> str:
        try:
            return str(self.inner.peer)
        except _PLUGIN_ERRORS:
            return f"{self._plugin}:?"

    async def write(self, ops: Sequence[WriteOp]) -> None:
        try:
            await self.inner.write(ops)
        except _PLUGIN_ERRORS as exc:
            # An unexplained failure may have moved some bytes and may move more: fence it.
            _reraise(self._plugin, f"write of {len(ops)} ops to {self.peer}", exc, may_land=True)

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        except _PLUGIN_ERRORS as exc:
            _reraise(self._plugin, f"closing the link to {self.peer}", exc)


class GuardedTransport(Transport):
    """A plugin's endpoint seen through the boundary (what the sessions hold)."""

    name = "guarded"

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        try:
            self.name = str(inner.name)  # type: ignore[misc]  # the wrapped plugin's name, per instance
            self.capabilities = inner.capabilities
        except _PLUGIN_ERRORS as exc:
            _reraise(getattr(type(inner), "name", type(inner).__name__), "reading its name and capabilities", exc)
        self._warnings = WarningBudget(log)
        self._lifetimes: dict[str, float] = {}
        """The last write_lifetime / orphan_lifetime the plugin gave (see :meth:`_lifetime`)."""

    @classmethod
    async def open(cls, options: Mapping[str, Any]) -> GuardedTransport:
        raise TransportError("open a plugin through open_guarded(), not GuardedTransport.open()")

    def reads_unregistered(self, device: str) -> bool:
        """Never an exception: a plugin that cannot say gets its sources registered (or staged), which every
        transport takes. Raised out of ``send()``, the error named no room and the ranks waiting were not told."""
        try:
            return bool(self.inner.reads_unregistered(device))
        except _PLUGIN_ERRORS as exc:  # a stray CancelledError too (a cancelled future's result()), as every guard
            if not isinstance(exc, Exception) and not stray_cancel(exc):
                raise
            self._warnings.warn("reads_unregistered", "transport %r: reads_unregistered(%r) raised %s: %s; its "
                                "sources are registered", self.name, device, type(exc).__name__, exc)
            return False

    @property
    def write_lifetime(self) -> float:
        return self._lifetime("write_lifetime")

    @property
    def orphan_lifetime(self) -> float:
        return self._lifetime("orphan_lifetime")

    def _lifetime(self, which: str) -> float:
        """How long a write may still land, as the plugin says: never an exception.

        These are read where the sessions settle their books (a failed write being recorded, a writer gone), where
        an exception would leave a write that may land on no book at all, and its blocks freed. A lifetime the
        plugin cannot give (it raises, or says NaN) is the last one it gave, or, if it never gave one, forever:
        the write then stays on the sender's books, and its blocks fenced, for the life of the sender (a
        revocation aside). Safe, and a warning says it."""
        try:
            value = float(getattr(self.inner, which))
        except _PLUGIN_ERRORS as exc:
            return self._lifetime_unknown(which, f"raised {type(exc).__name__}: {exc}")
        if math.isnan(value):  # max(0.0, nan) is 0.0: no fence at all
            return self._lifetime_unknown(which, "is NaN")
        self._lifetimes[which] = value = max(0.0, value)
        return value

    def _lifetime_unknown(self, which: str, why: str) -> float:
        known = self._lifetimes.get(which)
        taken = f"the last value it gave ({known} s) is used" if known is not None else (
            "taken as forever: a failed write that may land stays fenced until the sender closes")
        self._warnings.warn(which, "transport %r: %s %s; %s", self.name, which, why, taken)
        return known if known is not None else math.inf

    @property
    def writer_id(self) -> str:
        try:
            return str(self.inner.writer_id)
        except _PLUGIN_ERRORS as exc:
            _reraise(self.name, "writer_id", exc)

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        try:
            await self.inner.register(regions)
        except _PLUGIN_ERRORS as exc:
            _reraise(self.name, f"register() of {len(regions)} region(s)", exc)

    async def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        try:
            await self.inner.unregister(regions)
        except _PLUGIN_ERRORS as exc:
            _reraise(self.name, f"unregister() of {len(regions)} region(s)", exc)

    def descriptor(self) -> bytes:
        try:
            desc = self.inner.descriptor()
        except _PLUGIN_ERRORS as exc:
            _reraise(self.name, "descriptor()", exc)
        if not isinstance(desc, bytes):
            raise TransportError(f"transport {self.name!r}: descriptor() returned {type(desc).__name__}, not bytes")
        return desc

    async def connect(self, peer_descriptor: bytes) -> GuardedLink:
        try:
            link = await self.inner.connect(peer_descriptor)
        except _PLUGIN_ERRORS as exc:
            _reraise(self.name, "connect()", exc)
        return GuardedLink(link, self.name)

    async def revoke(self, writer_id: str) -> None:
        try:
            await self.inner.revoke(writer_id)
        except _PLUGIN_ERRORS as exc:
            _reraise(self.name, f"revoke({writer_id[:16]!r})", exc)

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        except _PLUGIN_ERRORS as exc:
            _reraise(self.name, "aclose()", exc)

    def __getattr__(self, name: str) -> Any:
        # Plugin-specific attributes (e.g. ``regions`` for tests and metrics) read through.
        return getattr(self.inner, name)
