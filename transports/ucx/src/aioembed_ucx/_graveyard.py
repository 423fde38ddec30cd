"""Buffers that UCX may still write into after their owner gave up on them.

A posted ucxx receive does not keep its buffer alive (only our reference does), and cancelling or
aborting can lag behind the Python code that stops waiting: a receive already matched to a rendezvous,
ucxx's progress thread in ``thread`` mode. So whoever abandons posted messages (a failed connect, an
incoming connection's handshake given up, a failed or cancelled write) buries them here with their
endpoint, and they are let go only once that endpoint is no longer alive and a grace period has passed.
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
    it) and a grace period has passed; live ones are kept, and a warning says if they pile up.

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
                alive = bool(endpoint.alive)
            except Exception:
                alive = False
            if alive:
                kept.append((endpoint, buffers, None))
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


GRAVEYARD = Graveyard()
