"""The core transport conformance suite, on UCX over TCP on loopback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from aioembed.testing import TransportConformance

from .conftest import UCX_OPTIONS


class _UcxConformance(TransportConformance):
    transport_name = "ucx"
    transport_options: ClassVar[Mapping[str, Any]] = UCX_OPTIONS
    backends = ("asyncio", "uvloop")
    large_bytes = 8 << 20
    peer_gone_timeout = 10.0


class TestUcxConformance(_UcxConformance):
    large_bytes = 32 << 20


class TestUcxConformanceInline(_UcxConformance):
    """Small ops batched into one message and copied into place by the owning side."""

    transport_options = dict(UCX_OPTIONS, inline_bytes=2048)


class TestUcxConformanceGoAhead(_UcxConformance):
    """Every write waits for the owner's go-ahead (no eager writes, which the default uses for small ones)."""

    transport_options = dict(UCX_OPTIONS, eager_bytes=0)
