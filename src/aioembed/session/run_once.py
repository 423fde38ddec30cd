"""A sender or receiver runs once, on the event loop that entered it.

Entered a second time, one opened a second transport endpoint and ZeroMQ context that nothing closed (a later
garbage collection hung in ZeroMQ's ``term()``); called from another thread's event loop, one spawned tasks into
its owner's task group from the wrong thread and failed much later with a misleading timeout. Both are refused
at once here, by name.
"""

from __future__ import annotations

import threading

from aioembed.errors import AioembedError

__all__ = ["RunOnce"]


class RunOnce:
    """The lifecycle facts both sides check: entered, started, and the thread whose loop owns the side."""

    __slots__ = ("_entered", "_kind", "_started", "_thread")

    def __init__(self, kind: str) -> None:
        self._kind = kind  # "sender" / "receiver"
        self._entered = False
        self._started = False
        self._thread: int | None = None

    def enter(self, *, closing: bool) -> None:
        """At ``__aenter__``, before anything is opened: refuse a second entry (also a concurrent one)."""
        if self._entered or closing:
            # After a failed __aenter__ (a bind or the transport refused) nothing ran: say so, not "entered".
            was = ("closed" if closing else "entered" if self._started
                   else "entered (that __aenter__() failed, or is still running)")
            cls = f"Embedding{self._kind.capitalize()}"
            raise AioembedError(f"this {self._kind} was {was} already: an {cls} runs once (one `async with`, or "
                                "one __aenter__() ... aclose()); make a new one")
        self._entered = True
        self._thread = threading.get_ident()

    def started(self) -> None:
        """``__aenter__`` returned."""
        self._started = True

    def check_thread(self) -> None:
        """Refuse a call from another thread than the one whose event loop entered the side."""
        here = threading.get_ident()
        if here != self._thread:
            raise AioembedError(f"the {self._kind} runs on the event loop of another thread (thread {self._thread}, "
                                f"this is {here}): call it from that loop (e.g. anyio.from_thread.run or "
                                f"asyncio.run_coroutine_threadsafe), or make a {self._kind} per event loop")
