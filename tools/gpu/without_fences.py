"""pytest plugin: the library WITHOUT its CUDA stream fences, to show that the GPU race tests catch the bug.

``-p without_fences`` (with ``tools/gpu`` on ``PYTHONPATH``) makes ``fence_after`` return ``None`` where the
sender orders its reads after the producing stream and where a lease orders its release after the
consumer's kernels, and drops the wait of a CUDA pool's copy-out for the caller's stream. The race tests
of :class:`aioembed.testing.gpu.CudaSuite` must then fail (see ``tools/gpu/check.sh``). Never loaded by
the project's own test runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from aioembed.memory.device_order import CudaFence
from aioembed.session import copy_out, lease, sender


def _no_fence(*args: Any, **kwargs: Any) -> None:
    """``fence_after`` as if every tensor were on the CPU: nothing to wait for."""
    return None


PATCHED = "fence_after"
"""The name each module below imported from :mod:`aioembed.memory.device_order` and calls."""


def _copy_without_waiting(
        self: copy_out.RoundCopier, blocks: Sequence[int], out: dict[str, torch.Tensor], start: int, count: int, *,
        after: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
    """``RoundCopier._copy_cuda`` without ``stream.wait_stream(after)``: the copy ignores the caller's kernels."""
    with torch.cuda.stream(stream):
        self.pool.copy_out(blocks, count, out, out_start=start)
    CudaFence(stream).wait()


def pytest_configure(config: pytest.Config) -> None:
    for module in (sender, lease):
        setattr(module, PATCHED, _no_fence)
    copy_out.RoundCopier._copy_cuda = _copy_without_waiting  # type: ignore[method-assign]
