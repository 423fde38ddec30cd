"""pytest plugin: the library WITHOUT its CUDA stream fences, to show that the GPU race tests catch the bug.

``-p without_fences`` (with ``tools/gpu`` on ``PYTHONPATH``) makes ``fence_after`` return ``None`` where the
sender orders its reads after the producing stream and where a lease orders its release after the
consumer's kernels. The race tests of :class:`aioembed.testing.gpu.CudaSuite` must then fail (see
``tools/gpu/check.sh``). Never loaded by the project's own test runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from aioembed.session import lease, sender


def _no_fence(*args: Any, **kwargs: Any) -> None:
    """``fence_after`` as if every tensor were on the CPU: nothing to wait for."""
    return None


PATCHED = "fence_after"
"""The name each module below imported from :mod:`aioembed.memory.device_order` and calls."""


def pytest_configure(config: pytest.Config) -> None:
    for module in (sender, lease):
        setattr(module, PATCHED, _no_fence)
