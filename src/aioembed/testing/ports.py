"""A TCP port for a test's listener that must stay at one address (a peer restarted on it)."""

from __future__ import annotations

import random
import socket

__all__ = ["fixed_port"]

_FLOOR = 20000
"""Lowest port picked: clear of the well-known and most registered services' ports."""


def _ephemeral_start() -> int:
    """Where the kernel's range of ports for outgoing connections begins."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def fixed_port() -> int:
    """A port that is free now, on every address, and below the kernel's ephemeral range.

    A port picked by binding port 0 lies in that range, where any outgoing connection of any process can
    take it between the pick and the test's listen: in CI (three plugin suites at once) an engine's
    connection took one, and the restarted peer could not listen. Outgoing connections never take a port
    below the range. Where the range starts too low to leave room, a port is picked by binding port 0."""
    start = _ephemeral_start()
    rng = random.SystemRandom()
    if start - _FLOOR >= 1000:
        for _ in range(200):
            port = rng.randrange(_FLOOR, start)
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    continue  # someone listens there (or holds it): pick again
                return port
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])
