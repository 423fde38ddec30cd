"""Whether a process is stopped (SIGSTOP is asynchronous: a test waits until it took effect)."""

from __future__ import annotations

import time


def is_stopped(pid: int) -> bool:
    """True once ``pid`` is in the stopped state ("T" in /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Block until ``pid`` is stopped (a few milliseconds); AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_stopped(pid):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")
