"""The owning side's UCX listener: ucxx's accept path, without its busy wait and with a deadline.

ucxx 0.52's ``create_listener`` runs the peer-info exchange (16 bytes each way: the message tag
each side receives on, and its hash) in a handler coroutine that awaits ``request.wait()``, which
outside ucxx's thread modes is ``wait_yield``: ``while not completed: await asyncio.sleep(0)``. A
peer that connects at the UCX level and then never sends its half (frozen, or not speaking ucxx)
kept the owner at 1 CPU-s/s for as long as the connection lasted, which was for good: its
``connect_timeout`` path frees the exchange buffers while UCX still has a receive posted into them,
so the plugin had to pass ``connect_timeout=1e9``.

:class:`Listener` takes the endpoint that UCX creates for each connection request
(``UCXListener.create(..., deliver_endpoint=True)``, as ucxx's own listener does) and runs the same
exchange itself, in the same order (the listener sends first, then receives; ucxx's and this plugin's
connecting sides receive first), waiting through :func:`~aioembed_ucx._progress.wait_request` (in
``blocking`` mode the loop's event-driven progress: no polling). A handshake that has not completed
within ``handshake_timeout`` seconds (the endpoint's ``connect_timeout``) is given up: its endpoint and
buffers go to the graveyard (kept while UCX may still write into them) and the endpoint is closed with a
close request (:func:`~aioembed_ucx._progress.close_posted`: ``close_blocking`` left the endpoint, and
with it ucxx's listener and its port, alive for good); :meth:`Listener.aclose` waits for those closes, so
the port is closed when it returns. Each connection has its own task, so a stuck handshake never holds up
another peer's.

It takes at most ``max_connections`` connections at a time (handshaking or served): past it, a new one is
closed at once, before its handshake, counted in :attr:`Listener.connections_refused`, and logged at most once
per :data:`REFUSAL_LOG_SECONDS` (a storm of connections must not become a storm of log lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import logging
import os
import struct
import time
import types
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from aioembed_ucx._graveyard import GRAVEYARD
from aioembed_ucx._progress import close_at_once, close_posted, wait_request

__all__ = ["Listener"]

_RETIRED: list[Any] = []
"""ucxx listeners of closed :class:`Listener` s with an endpoint of a given-up handshake that UCX had not closed
within ``handshake_timeout`` of the close: that endpoint keeps ucxx's C++ listener, which calls back with the
Python object's data; so the object is kept too (a late connection is then closed at once instead of
meeting freed data)."""

log = logging.getLogger("aioembed.transports.ucx")

REFUSAL_LOG_SECONDS = 10.0
"""The least time between two warnings about refused connections (those between are counted, not logged)."""

_PEER_INFO = struct.Struct("QQ")
"""ucxx's peer-info message: the tag its sender receives on, and ``hash64bits`` of it."""


@functools.cache
def _ucxx() -> types.SimpleNamespace:
    """The ucxx internals (untyped) that ``create_listener`` and its handler use in ucxx 0.52."""
    return types.SimpleNamespace(
        UCXListener=importlib.import_module("ucxx._lib.libucxx").UCXListener,
        Array=importlib.import_module("ucxx._lib.arr").Array,
        Endpoint=importlib.import_module("ucxx._lib_async.endpoint").Endpoint,
        hash64bits=importlib.import_module("ucxx._lib_async.utils").hash64bits,
    )


class Listener:
    """A UCX listener on ``port`` (0: any) that hands each connection, once its peer-info exchange is
    done, to ``on_endpoint`` (a ucxx ``Endpoint``), in a task of the listener's own. Create it on the
    event loop that serves it; :meth:`aclose` stops it and cancels its tasks."""

    def __init__(self, ucxx: Any, port: int, on_endpoint: Callable[[Any], Awaitable[None]],
                 handshake_timeout: float, max_connections: int) -> None:
        if max_connections <= 0:
            raise ValueError(f"max_connections={max_connections} must be > 0")
        u = _ucxx()
        self._loop = asyncio.get_running_loop()
        self._ctx = ucxx.core._get_ctx()
        self._ctx.continuous_ucx_progress()  # as create_listener (a no-op where the loop has progress)
        self._on_endpoint = on_endpoint
        self.handshake_timeout = handshake_timeout
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: set[Any] = set()
        """Close requests of the endpoints of given-up handshakes, until they completed."""
        self._closed = False
        self._outlived = False
        self.handshaking = 0
        """Connections whose peer-info exchange is under way."""
        self.handshakes_given_up = 0
        """Connections closed because their exchange did not complete within ``handshake_timeout``."""
        self.max_connections = max_connections
        self.connections_refused = 0
        """Connections closed at once because ``max_connections`` were open."""
        self._unlogged_refusals = 0
        self._refusal_logged_at: float | None = None
        # The callback holds the listener weakly: UCX keeps the callback's arguments for the listener's life.
        self._raw: Any = u.UCXListener.create(worker=self._ctx.worker, port=port, cb_func=_on_connection,
                                              cb_args=(weakref.ref(self),), deliver_endpoint=True)
        self.port = int(self._raw.port)

    @property
    def closed(self) -> bool:
        return self._closed

    def _accepted(self, endpoint: Any) -> None:
        """On the loop: a new connection's endpoint (UCX created it from the connection request)."""
        if self._closed:
            close_at_once(endpoint)
            return
        if len(self._tasks) >= self.max_connections:
            close_at_once(endpoint)  # before the handshake: nothing is posted on it yet
            self._refused()
            return
        task = self._loop.create_task(self._handshake(endpoint))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def connections(self) -> int:
        """Connections open now: in their handshake or handed over (each has its task until it ends)."""
        return len(self._tasks)

    def _refused(self) -> None:
        self.connections_refused += 1
        self._unlogged_refusals += 1
        now = time.monotonic()
        if self._refusal_logged_at is not None and now - self._refusal_logged_at < REFUSAL_LOG_SECONDS:
            return
        log.warning("ucx: refused %d incoming connection(s) on port %s%s: max_connections=%d connections are open "
                    "(transport_options.max_connections); %d refused in all, the next warning comes %s s later at "
                    "the earliest", self._unlogged_refusals, self.port,
                    "" if self._refusal_logged_at is None else f" in the last {now - self._refusal_logged_at:.0f} s",
                    self.max_connections, self.connections_refused, REFUSAL_LOG_SECONDS)
        self._refusal_logged_at = now
        self._unlogged_refusals = 0

    async def _handshake(self, endpoint: Any) -> None:
        u = _ucxx()
        msg_tag = u.hash64bits("msg_tag", os.urandom(16), endpoint.handle)
        mine = _PEER_INFO.pack(msg_tag, u.hash64bits(msg_tag))
        theirs = bytearray(_PEER_INFO.size)
        mine_arr, theirs_arr = u.Array(mine), u.Array(theirs)
        failure: str | None = None
        self.handshaking += 1
        try:
            try:
                async with asyncio.timeout(self.handshake_timeout):
                    await wait_request(endpoint.stream_send(mine_arr))
                    await wait_request(endpoint.stream_recv(theirs_arr))
            except TimeoutError:
                self.handshakes_given_up += 1
                failure = "timeout"
            except Exception as exc:  # a UCX error: the peer went away (or closed) before it was done
                failure = repr(exc)
        except BaseException:  # cancelled: the listener is closing (and waits for the close)
            self._give_up(endpoint, mine, theirs, mine_arr, theirs_arr)
            raise
        finally:
            self.handshaking -= 1
        if failure is not None:
            # A receive may still be posted into ``theirs``: UCX can write into it until the endpoint is closed.
            closing = self._give_up(endpoint, mine, theirs, mine_arr, theirs_arr)
            if closing is not None:
                await self._wait_closed([closing])  # cancelled: aclose() waits for it
            if failure == "timeout":
                log.warning("ucx: a peer connected but did not complete the UCX handshake within "
                            "connect_timeout=%s s (frozen, or not a ucxx peer); its connection was closed",
                            self.handshake_timeout)
            else:
                log.debug("ucx: an incoming connection ended during its UCX handshake: %s", failure)
            return
        peer_tag, checksum = _PEER_INFO.unpack(theirs)
        if checksum != u.hash64bits(peer_tag):
            log.warning("ucx: an incoming connection sent a bad UCX handshake (checksum mismatch); closed it")
            close_at_once(endpoint)
            return
        ep = u.Endpoint(endpoint=endpoint, ctx=self._ctx, tags={"msg_send": peer_tag, "msg_recv": msg_tag})
        ep._aioembed_ucx_listener = self._raw  # its callback data must outlive every endpoint of it
        await self._on_endpoint(ep)

    def _give_up(self, endpoint: Any, *buffers: object) -> Any:
        """Close a connection that may have a receive posted, keeping its buffers while UCX may write into them;
        the close request, kept until it completed (``None``: the endpoint had failed, and is closed)."""
        GRAVEYARD.bury(endpoint, *buffers)
        try:
            closing = close_posted(endpoint)
        except Exception as exc:  # not closed: ucxx keeps the endpoint, and with it its listener
            log.warning("ucx: cannot close an incoming connection whose UCX handshake was given up (%r); "
                        "the listener's port stays open until the process exits", exc)
            self._outlived = True
            return None
        if closing is not None:
            self._closing.add(closing)
        return closing

    async def _wait_closed(self, requests: list[Any]) -> None:
        """Until UCX closed the endpoints of these close requests (each one's failure is the endpoint's end
        too), at most ``handshake_timeout``; those not closed by then are left to UCX."""
        with anyio.move_on_after(self.handshake_timeout):
            for request in requests:
                with contextlib.suppress(Exception):
                    await wait_request(request)
                self._closing.discard(request)

    async def aclose(self) -> None:
        """Stop listening and cancel every connection's task (handshakes and what they handed over); returns
        once the port is closed (unless UCX did not close a given-up handshake's endpoint in time)."""
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._closing:  # endpoints of handshakes given up: closed by UCX's progress, in a moment
            await self._wait_closed(list(self._closing))
        if self._closing:
            log.warning("ucx: %d incoming connections whose UCX handshake was given up were not closed within "
                        "connect_timeout=%s s; the listener's port %s stays open while UCX keeps them",
                        len(self._closing), self.handshake_timeout, self.port)
            self._outlived = True
            self._closing.clear()
        GRAVEYARD.prune(time.monotonic())  # dead endpoints let go of ucxx's listener (and its port) now
        if self._outlived:
            # An endpoint that UCX did not close stays referenced inside ucxx, and with it ucxx's C++ listener,
            # which calls back with this object's data: keep it.
            _RETIRED.append(self._raw)
        self._raw = None
        self._ctx = None


def _on_connection(endpoint: Any, listener_ref: weakref.ref[Listener]) -> None:
    """UCX's connection callback: inside the worker's progress (on the loop's thread, or on ucxx's progress
    thread in the thread modes). Hands the endpoint to the listener's loop, which closes it if the listener
    closed meanwhile; never raises into UCX, and never closes an endpoint in the middle of a progress."""
    listener = listener_ref()
    if listener is None:
        return  # our listener is gone (ucxx's may live on, kept by an endpoint): dropping the endpoint closes it
    with contextlib.suppress(RuntimeError):  # the loop closed: as above
        listener._loop.call_soon_threadsafe(listener._accepted, endpoint)
