"""Transports: the interface, the registry, and the built-in loopback transport."""

from aioembed.transports.base import (
    Link,
    MemoryRegion,
    RegionSet,
    Transport,
    TransportCapabilities,
    WriteOp,
)
from aioembed.transports.registry import (
    ENTRY_POINT_GROUP,
    available_transports,
    check_transport_options,
    open_configured,
    open_transport,
    resolve_transport,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Link",
    "MemoryRegion",
    "RegionSet",
    "Transport",
    "TransportCapabilities",
    "WriteOp",
    "available_transports",
    "check_transport_options",
    "open_configured",
    "open_transport",
    "resolve_transport",
]
