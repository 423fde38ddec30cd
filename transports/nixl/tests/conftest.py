"""Shared settings of the NIXL plugin tests."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

ONE_HOST: dict[str, Any] = {"tcp_orphan_seconds": 1.0}
"""Every process of these tests on one host: no partition can hold a closed socket's bytes, and a killed or
restarted writer's blocks come back within the tests' waits (the default over TCP, what the kernel retransmits,
is 104 s; UCX left to choose counts as TCP). Not for the partition suite, whose network can hold them."""

NIXL_OPTIONS: dict[str, Any] = {"write_timeout": 10.0, **ONE_HOST}
"""UCX picks its transports (shared memory between processes of one host, cma here)."""

NIXL_TCP_OPTIONS: dict[str, Any] = {"ucx_tls": "tcp", "write_timeout": 10.0, **ONE_HOST}
"""UCX over TCP only: the path two hosts take (the owner's progress thread must run for a write to land)."""
