"""The event channel of a child process that reports to its parent in JSON lines on stdout: the bench's
receiving peer, a raw baseline's destination, the memory child, the test processes.

Native libraries such a child loads write to file descriptor 1 as well (UCX logs its warnings to stdout unless
told otherwise), and a line of theirs would land in the parent's event stream. So the child claims its stdout
once, at start, before those libraries load: events go to a private duplicate of descriptor 1, and descriptor 1
itself (and ``sys.stdout``) then point at stderr, where the parent keeps what the child logs for its errors.
``aioembed bench --json -`` keeps its own stdout the same way while it runs (:func:`claimed_stdout`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["claim_stdout", "claimed_stdout", "emit", "last_event", "parse_event"]

log = logging.getLogger(__name__)

_channel: TextIO | None = None


def _divert_stdout() -> TextIO:
    """A stream on what stdout is now; descriptor 1 and ``sys.stdout`` go to stderr from here on."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def claim_stdout() -> None:
    """Keep stdout for :func:`emit` alone, for good; anything else written to it goes to stderr from now on.
    For a child process, called before it loads a native library (in its ``__main__`` block, so that a test
    calling its ``main()`` in-process keeps its own stdout)."""
    global _channel  # noqa: PLW0603  (stdout is one per process)
    if _channel is None:
        _channel = _divert_stdout()


@contextmanager
def claimed_stdout() -> Iterator[TextIO]:
    """Within the block, stdout is the yielded stream's alone (``aioembed bench --json -`` writes its report
    there) and what else is written to it goes to stderr; stdout is given back afterwards."""
    saved_fd, saved = os.dup(1), sys.stdout
    out = _divert_stdout()
    try:
        yield out
    finally:
        out.close()
        sys.stdout = saved
        os.dup2(saved_fd, 1)
        os.close(saved_fd)


def emit(**event: Any) -> None:
    """Write one event, a JSON object on a line of its own, to the parent (``sys.stdout`` until
    :func:`claim_stdout` was called)."""
    out = _channel if _channel is not None else sys.stdout
    out.write(json.dumps(event, default=str) + "\n")
    out.flush()


def parse_event(line: bytes, who: str) -> dict[str, Any] | None:
    """The event on one line from a child's stdout, or ``None`` (logged) for a line that is not one: a
    child that did not claim its stdout, or a library that wrote there before it did."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        log.warning("%s wrote a line that is not an event, skipped: %r", who, line[:300])
        return None
    return event


def last_event(output: bytes, who: str) -> dict[str, Any] | None:
    """The last event in a finished child's whole stdout (its result), or ``None``: other lines (a native
    library writing at exit) are skipped."""
    events = [e for e in (parse_event(line, who) for line in output.splitlines() if line) if e is not None]
    return events[-1] if events else None
