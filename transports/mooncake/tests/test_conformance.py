"""The core transport conformance suite, on mooncake over TCP on loopback (asyncio, uvloop and trio)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
from aioembed.testing import TransportConformance


class TestMooncakeConformance(TransportConformance):
    transport_name = "mooncake"
    # Both endpoints on one host: no partition can hold a closed socket's bytes, so the kernel's orphan retransmits
    # (about 100 s by default over TCP) are not waited for, and a writer closing is watched past its orphan lifetime.
    # A cancelled write's lifetime stays 32 s (the engine's progress timeout, never lower): not watched here.
    transport_options: ClassVar[Mapping[str, Any]] = {"protocol": "tcp", "tcp_orphan_seconds": 1.0}
    large_bytes = 16 << 20  # TCP loopback runs at about 1 GB/s on a small CI box
    peer_gone_timeout = 10.0


@pytest.mark.slow
class TestMooncakeConformanceLongLifetimes(TestMooncakeConformance):
    """The suite again, waiting out a cancelled write's 32 s lifetime to watch for its bytes past it (`make soak`):
    the suite above skips that check, naming the lifetime."""

    late_landing_wait = 40.0
