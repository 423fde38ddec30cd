"""The core transport conformance suite, on mooncake over TCP on loopback (asyncio and trio)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from aioembed.testing import TransportConformance


class TestMooncakeConformance(TransportConformance):
    transport_name = "mooncake"
    transport_options: ClassVar[Mapping[str, Any]] = {"protocol": "tcp"}
    large_bytes = 16 << 20  # TCP loopback runs at about 1 GB/s on a small CI box
    peer_gone_timeout = 10.0
