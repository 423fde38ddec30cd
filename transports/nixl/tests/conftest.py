"""Shared settings of the NIXL plugin tests."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

NIXL_OPTIONS: dict[str, Any] = {"write_timeout": 10.0}
"""UCX picks its transports (shared memory between processes of one host, cma here)."""

NIXL_TCP_OPTIONS: dict[str, Any] = {"ucx_tls": "tcp", "write_timeout": 10.0}
"""UCX over TCP only: the path two hosts take (the owner's progress thread must run for a write to land)."""
