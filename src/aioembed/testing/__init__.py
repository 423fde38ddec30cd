"""Test support shipped with aioembed: the transport conformance suite and a fault-injecting transport."""

from aioembed.testing.conformance import TransportConformance, region_of
from aioembed.testing.mock import MockTransport, WriteCall, WriteFault

__all__ = ["MockTransport", "TransportConformance", "WriteCall", "WriteFault", "region_of"]
