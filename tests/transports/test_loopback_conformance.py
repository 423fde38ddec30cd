"""The loopback transport passes the core conformance suite."""

from aioembed.testing import TransportConformance


class TestLoopbackConformance(TransportConformance):
    transport_name = "loopback"


class TestLoopbackConformanceThreaded(TransportConformance):
    """Every write goes through the worker-thread path."""

    transport_name = "loopback"
    transport_options = {"inline_bytes": 0, "threads": 2}
    large_bytes = 8 << 20


class TestLoopbackConformanceUnregisteredSources(TransportConformance):
    """Writes read CPU sources that were never registered (as Mooncake over TCP and UCX without RDMA do)."""

    transport_name = "loopback"
    transport_options = {"unregistered_sources": True}
