"""The core transport conformance suite, on NIXL's UCX backend (shared memory, then TCP on loopback)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from aioembed.testing import TransportConformance

from .conftest import NIXL_OPTIONS, NIXL_TCP_OPTIONS

LIFETIMES_WATCHED: dict[str, Any] = {"write_timeout": 3.0}
"""A cancelled write's ``write_lifetime`` is its write timeout (NIXL cannot abort it): 3 s, within the suite's
``late_landing_wait``, so that the suite watches for its bytes past it (10 s went unwatched). Writes here take
milliseconds."""


class TestNixlConformance(TransportConformance):
    transport_name = "nixl"
    transport_options: ClassVar[Mapping[str, Any]] = {**NIXL_OPTIONS, **LIFETIMES_WATCHED}
    large_bytes = 32 << 20
    peer_gone_timeout = 10.0
    closed_peer_seen_at_once = False  # shared memory, in-process: a copy needs nothing of the closed peer's worker


class TestNixlConformanceTcp(TransportConformance):
    transport_name = "nixl"
    transport_options: ClassVar[Mapping[str, Any]] = {**NIXL_TCP_OPTIONS, **LIFETIMES_WATCHED}
    backends = ("asyncio", "uvloop")
    large_bytes = 16 << 20
    peer_gone_timeout = 10.0
