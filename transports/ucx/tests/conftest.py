"""Shared settings of the UCX plugin tests."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

# Every ucx endpoint of one process must use the same per-process UCX settings.
UCX_OPTIONS: dict[str, Any] = {
    "tls": "tcp",
    "progress_mode": os.environ.get("AIOEMBED_UCX_TEST_PROGRESS", "blocking"),
    "write_timeout": 5.0,
    "connect_timeout": 5.0,
    # Every process of these tests on one host: no partition can hold a closed socket's bytes, and a killed or
    # restarted writer's blocks come back within the tests' waits (the default over TCP, what the kernel
    # retransmits, is 104 s). Not for the partition suite, whose network can hold them.
    "tcp_orphan_seconds": 1.0,
}


def ucx_transport(t: Any) -> Any:
    """The plugin's endpoint behind the session's boundary (tests look inside it)."""
    from aioembed.transports.boundary import GuardedTransport

    from aioembed_ucx.transport import UcxTransport

    inner = t.inner if isinstance(t, GuardedTransport) else t
    assert isinstance(inner, UcxTransport)
    return inner


def ucx_link(link: Any) -> Any:
    """The plugin's link behind the session's boundary."""
    from aioembed.transports.boundary import GuardedLink

    from aioembed_ucx.transport import UcxLink

    inner = link.inner if isinstance(link, GuardedLink) else link
    assert isinstance(inner, UcxLink)
    return inner
