"""Buffers that UCX may still write into after their owner gave up on them.

A posted ucxx receive does not keep its buffer alive (only our reference does), and cancelling or
aborting can lag behind the Python code that stops waiting: a receive already matched to a rendezvous,
ucxx's progress thread in ``thread`` mode (there, measured with ucxx 0.52, every one of 50 aborts after the
peer's failure returned with its receives still posted; ucxx cancelled them on its thread ~1 ms later). So
whoever abandons posted messages (a failed connect, an incoming connection's handshake given up, a failed or
cancelled write) buries them here with their endpoint.

A message buried with its ucxx request is let go once that request completed or was cancelled: UCX's own
word that it is done with the buffer. The request is dropped then too, never kept longer: a ucxx request
holds its C++ endpoint, and an endpoint accepted by a listener holds ucxx's C++ listener, which goes on
accepting on the port and calls back into the data of the closed owner's Python listener (measured: a
completed request kept after the listener's close made a new client hit ``KeyError: 'cb_func'``). Buffers
buried without a request (a handshake's stream receive, ended by closing its endpoint) are let go once their
endpoint is no longer alive and :attr:`Graveyard.GRACE` has passed.

A ucxx request cannot be watched instead of kept: ``UCXRequest`` takes no weak reference, and ucxx keeps
no reference to it (only its C++ request is kept until UCX completes it). So an owner's close first waits
for what is still posted (:func:`aioembed_ucx._progress.settle_graveyard`) and then calls
:meth:`Graveyard.keep_posted_for_good`: what UCX still has not completed keeps its buffer for the life of
the process, and its request and endpoint are let go.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["GRAVEYARD", "Graveyard"]

log = logging.getLogger("aioembed.transports.ucx")

_Held = tuple[object, Any]
"""A buried buffer and the ucxx request posted into it (``None``: none known, the endpoint's end counts)."""


class Graveyard:
    """Endpoints of failed connects and writes, kept with the buffers UCX may still write into.

    ucxx's create_endpoint() frees its peer-info buffers when its connect timeout fires, while
    UCX still has a stream receive posted into them: a peer that was frozen and wakes up later
    then corrupts the heap (reproduced with ucxx 0.52: segfault after SIGSTOP/SIGCONT). So we do
    the same steps ourselves and, on failure, keep the buffers and the endpoint. A buffer buried with
    its request goes once that request completed; one without goes once its endpoint is no longer
    alive and a grace period has passed. Live endpoints are kept, and a warning says if they pile up.

    Pruning runs at each burial, at an owner's close, and, while anything is kept, on a timer :attr:`GRACE`
    seconds later on the running event loop. (Pruned only at the next burial, what a process's last failure
    had kept, an owner's eager scratch, write bodies, inline blobs and the dead endpoints themselves, stayed
    referenced for good.)
    """

    GRACE = 30.0
    WARN_AT = 1024

    def __init__(self) -> None:
        self._entries: list[tuple[Any, list[_Held], float | None]] = []  # (endpoint, held, dead since)
        self._warned = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self.kept_for_good: list[object] = []
        """Buffers whose requests UCX had not completed when an owner closed (see :meth:`keep_posted_for_good`)."""

    def bury(self, endpoint: Any, *buffers: object) -> None:
        """Keep ``buffers`` until ``endpoint`` is no longer alive, and a grace period more."""
        self._add(endpoint, [(b, None) for b in buffers])

    def bury_posted(self, endpoint: Any, posted: Iterable[_Held]) -> None:
        """Keep each ``(buffer, request)`` until UCX completed or cancelled the request."""
        self._add(endpoint, [(b, r) for b, r in posted if not _completed(r)])

    def _add(self, endpoint: Any, held: list[_Held]) -> None:
        self.prune(time.monotonic())
        if not held:
            return
        self._entries.append((endpoint, held, None))
        if len(self._entries) >= self.WARN_AT and not self._warned:
            self._warned = True
            log.warning("ucx: %d endpoints of failed connects or writes are still alive (peers frozen?); their "
                        "buffers are kept while UCX may write into them", len(self._entries))
        self._arm()

    def _arm(self) -> None:
        """Prune again in :attr:`GRACE` seconds while entries are kept (a timer on the running loop, not a task;
        none where no loop runs here: the next burial or owner's close prunes)."""
        if not self._entries:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        pending, on = self._timer, self._timer_loop
        if pending is not None and on is not None and not on.is_closed() and not pending.cancelled():
            if on is not loop or pending.when() <= loop.time() + self.GRACE:
                return  # that one prunes in time (another loop's: left to it, its handles are not ours to cancel)
            pending.cancel()  # due later than a grace period from now (GRACE was lowered)
        self._timer, self._timer_loop = loop.call_later(self.GRACE, self._on_timer), loop

    def _on_timer(self) -> None:
        self._timer = self._timer_loop = None
        self.prune(time.monotonic())

    def prune(self, now: float) -> None:
        kept: list[tuple[Any, list[_Held], float | None]] = []
        for endpoint, was_held, dead_since in self._entries:
            held = [(b, r) for b, r in was_held if r is None or not _completed(r)]  # completed: UCX is done with it
            if not held:
                continue
            try:
                alive = endpoint is not None and bool(endpoint.alive)
            except Exception:
                alive = False
            if alive:
                kept.append((endpoint, held, None))
            elif any(r is not None for _, r in held):
                # Let go of a dead endpoint at once (it holds its ucxx listener, and that one its port); the
                # requests still posted say when their buffers may go.
                kept.append((None, held, None))
            elif dead_since is None:
                kept.append((None, held, now))  # the buffers stay for the grace period
            elif now - dead_since < self.GRACE:
                kept.append((None, held, dead_since))
        self._entries = kept
        self._arm()

    def posted_requests(self) -> list[Any]:
        """The buried requests that UCX has not completed yet."""
        return [r for _, held, _ in self._entries for _, r in held if r is not None and not _completed(r)]

    def keep_posted_for_good(self, waited: float) -> None:
        """An owner closed: keep the buffers of requests still posted for the life of the process, and let go
        of those requests and their endpoints (a kept request keeps its endpoint, and that one the closed
        owner's listener). Bounded by what was in flight at the close; said at WARNING."""
        self.prune(time.monotonic())
        kept: list[tuple[Any, list[_Held], float | None]] = []
        count = size = 0
        for endpoint, held, dead_since in self._entries:
            rest = []
            for buffer, request in held:
                if request is None:
                    rest.append((buffer, request))
                else:
                    self.kept_for_good.append(buffer)
                    count += 1
                    size += _nbytes(buffer)
            if rest:
                kept.append((endpoint, rest, dead_since))
        self._entries = kept
        if count:
            log.warning("ucx: %d posted messages (%d bytes) of aborted connections were neither completed nor "
                        "cancelled by UCX within %s s (connect_timeout) of an endpoint's close; their buffers are "
                        "kept until the process exits", count, size, waited)

    def __len__(self) -> int:
        return len(self._entries)


def _completed(request: Any) -> bool:
    """Whether UCX completed (or cancelled) ``request``; one whose state cannot be read counts as posted (kept,
    rather than freed while UCX may write into it)."""
    try:
        return bool(request.completed)
    except Exception:
        log.debug("ucx: cannot read a buried request's state; its buffer is kept", exc_info=True)
        return False


def _nbytes(buffer: object) -> int:
    try:
        return int(getattr(buffer, "nbytes", None) or memoryview(buffer).nbytes)  # type: ignore[arg-type]
    except TypeError:
        return 0


GRAVEYARD = Graveyard()
