"""The core transport conformance suite, on NIXL's UCX backend (shared memory, then TCP on loopback)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from aioembed.testing import TransportConformance

from .conftest import NIXL_OPTIONS, NIXL_TCP_OPTIONS


class TestNixlConformance(TransportConformance):
    transport_name = "nixl"
    transport_options = NIXL_OPTIONS
    large_bytes = 32 << 20
    peer_gone_timeout = 10.0
    closed_peer_seen_at_once = False  # shared memory, in-process: a copy needs nothing of the closed peer's worker


class TestNixlConformanceTcp(TransportConformance):
    transport_name = "nixl"
    transport_options: ClassVar[Mapping[str, Any]] = NIXL_TCP_OPTIONS
    backends = ("asyncio", "uvloop")
    large_bytes = 16 << 20
    peer_gone_timeout = 10.0
