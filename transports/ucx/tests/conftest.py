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
}
