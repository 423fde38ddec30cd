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

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aioembed.errors import ConfigError

__all__ = ["orphan_horizon", "orphan_retransmit_horizon", "tcp_orphan_seconds_option", "ucx_tls_may_use_tcp"]

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


def tcp_orphan_seconds_option(options: Mapping[str, Any]) -> float | None:
    """A plugin's ``tcp_orphan_seconds`` option (seconds in [0, 86400]; None: not set), checked."""
    value = options.get("tcp_orphan_seconds")
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or not 0 <= value <= 86400:
        raise ConfigError(f"transport_options.tcp_orphan_seconds must be a number of seconds in [0, 86400], "
                          f"got {value!r}")
    return float(value)


def orphan_horizon(tcp_orphan_seconds: float | None) -> float:
    """The horizon an endpoint over TCP uses: its ``tcp_orphan_seconds`` option, else this host's
    (:func:`orphan_retransmit_horizon`). Read once per endpoint: the lifetimes are asked after every write."""
    return tcp_orphan_seconds if tcp_orphan_seconds is not None else orphan_retransmit_horizon()


def ucx_tls_may_use_tcp(tls: str | None) -> bool:
    """Whether UCX with this ``UCX_TLS`` setting may carry a write's bytes over TCP: ``tcp`` or ``all`` is named,
    or an exclusion list (``^...``) leaves ``tcp`` in, or UCX chooses (no setting: TCP between hosts without RDMA,
    which an endpoint cannot rule out in advance). ``sockcm`` only connects (it carries no write's data)."""
    if not tls or not tls.strip():
        return True
    tls = tls.strip().lower()
    # "tcp:aux" (auxiliary only) counted as tcp: erring long costs a wait, erring short a corruption.
    names = {n.strip().split(":", 1)[0] for n in tls.removeprefix("^").split(",")}
    if tls.startswith("^"):
        return "tcp" not in names
    return bool(names & {"tcp", "all"})
