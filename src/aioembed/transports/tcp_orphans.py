"""How long a closed TCP socket's bytes may still reach its peer: a bound for plugins that write over TCP.

A native engine that gives up on a connection closes its socket, and a process that ends has its sockets closed by
its kernel. The close is graceful (no ``SO_LINGER`` of 0 in the engines): what was queued stays with the kernel,
which goes on retransmitting it to the peer, an *orphaned* socket, ``tcp_orphan_retries`` times (0 means 8) with
the retransmission timeout doubling from its 200 ms floor up to 120 s. Across a partition that heals in that time
(or a peer that was frozen and reads again), those bytes are delivered, and a receiving engine that reads straight
into registered memory (Mooncake's TCP transport) writes them where the write was aimed. Seconds count from the
close; the peer's own buffers add nothing once it reads.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["orphan_retransmit_horizon"]

_RTO_MIN = 0.2
_RTO_MAX = 120.0
_ORPHAN_RETRIES = Path("/proc/sys/net/ipv4/tcp_orphan_retries")


def orphan_retransmit_horizon(retries: int | None = None) -> float:
    """Seconds after its close that an orphaned TCP socket may still deliver bytes: every retransmission timeout
    of ``retries`` retries (this host's ``tcp_orphan_retries``; 0 means Linux's 8), and the last one's wait, from
    the floor up (a socket whose timeout had backed off already dies sooner: fewer retries are left to it).
    102.2 s with Linux's defaults. Where the setting cannot be read (not Linux), Linux's default is assumed."""
    if retries is None:
        try:
            retries = int(_ORPHAN_RETRIES.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            retries = 0
    retries = retries if retries > 0 else 8
    return sum(min(_RTO_MIN * 2.0**k, _RTO_MAX) for k in range(retries + 1))
