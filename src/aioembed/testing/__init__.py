"""Test support shipped with aioembed: the transport conformance suite."""

from aioembed.testing.conformance import TransportConformance, region_of

__all__ = ["TransportConformance", "region_of"]
