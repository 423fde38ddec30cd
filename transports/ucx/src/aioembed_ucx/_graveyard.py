"""Buffers that UCX may still write into after their owner gave up on them.

A posted ucxx receive does not keep its buffer alive (only our reference does), and cancelling or
aborting can lag behind the Python code that stops waiting: a receive already matched to a rendezvous,
ucxx's progress thread in ``thread`` mode. So whoever abandons posted messages (a failed connect, an
incoming connection's handshake given up, a failed or cancelled write) buries them here with their
endpoint, and they are let go only once that endpoint is no longer alive, every buried request that says
whether it completed (a ucxx request, a :class:`~aioembed_ucx._progress.Posted`) has, and a grace period has passed.

Why the requests too: an endpoint's abort does not prove that UCX let go of what was posted on it. In ucxx's
``thread`` progress modes, after the peer failed, ucxx's error handler only *schedules* the cancellation of the
endpoint's requests on the progress thread, and ``abort()`` returns at once (measured: 20 of 50 aborts returned
with receives still posted, all cancelled within milliseconds); an abort whose cancel or close the progress thread
did not run in time (3 s per attempt, 10 s for the close) gives up with them posted. Only a request's completion
says that UCX is done with its buffer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

__all__ = ["GRAVEYARD", "Graveyard"]

log = logging.getLogger("aioembed.transports.ucx")


class Graveyard:
    """Endpoints of failed connects and writes, kept with the buffers UCX may still write into.

    ucxx's create_endpoint() frees its peer-info buffers when its connect timeout fires, while
    UCX still has a stream receive posted into them: a peer that was frozen and wakes up later
    then corrupts the heap (reproduced with ucxx 0.52: segfault after SIGSTOP/SIGCONT). So we do
    the same steps ourselves and, on failure, keep the buffers and the endpoint. An entry is
    dropped once its endpoint is no longer alive (UCX completed or cancelled what was posted on
    it), every buried request completed (see :func:`_still_posted`), and a grace period has passed; live ones
    are kept, and a warning says if they pile up. A dead endpoint is let go at once even while requests are still
    posted (it holds its ucxx listener, and that one its port); the buffers and requests stay.

    Pruning runs at each burial and, while anything is kept, on a timer :attr:`GRACE` seconds later on the
    running event loop. (Pruned only at the next burial, what a process's last failure had kept, an owner's
    eager scratch, write bodies, inline blobs and the dead endpoints themselves, stayed referenced for good.)
    """

    GRACE = 30.0
    WARN_AT = 1024

    def __init__(self) -> None:
        self._entries: list[tuple[Any, tuple[object, ...], float | None]] = []  # (endpoint, buffers, dead since)
        self._warned = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def bury(self, endpoint: Any, *buffers: object) -> None:
        self.prune(time.monotonic())
        self._entries.append((endpoint, buffers, None))
        if len(self._entries) >= self.WARN_AT and not self._warned:
            self._warned = True
            log.warning("ucx: %d endpoints of failed connects or writes are still alive (peers frozen?); their "
                        "buffers are kept while UCX may write into them", len(self._entries))
        self._arm()

    def _arm(self) -> None:
        """Prune again in :attr:`GRACE` seconds while entries are kept (a timer on the running loop, not a task;
        none where no loop runs here: the next burial or listener close prunes)."""
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
        kept: list[tuple[Any, tuple[object, ...], float | None]] = []
        for endpoint, buffers, dead_since in self._entries:
            try:
                alive = endpoint is not None and bool(endpoint.alive)
            except Exception:
                alive = False
            if alive:
                kept.append((endpoint, buffers, None))
            elif any(_still_posted(b) for b in buffers):
                kept.append((None, buffers, None))  # UCX may still write into them: no grace period yet
            elif dead_since is None:
                # Dead: let go of the endpoint now (it holds its ucxx listener, and that one its port); the
                # buffers stay for the grace period.
                kept.append((None, buffers, now))
            elif now - dead_since < self.GRACE:
                kept.append((endpoint, buffers, dead_since))
        self._entries = kept
        self._arm()

    def __len__(self) -> int:
        return len(self._entries)


def _still_posted(kept: object) -> bool:
    """Whether ``kept`` is a request (or holds one) that UCX has neither completed nor cancelled yet: anything
    with a ``completed`` attribute that is false. A request whose state cannot be read counts as posted (kept
    for good rather than freed while UCX may write into it); buffers have no ``completed`` and count as done."""
    try:
        completed = getattr(kept, "completed", True)
        return not bool(completed)
    except Exception:
        return True


GRAVEYARD = Graveyard()
