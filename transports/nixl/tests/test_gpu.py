"""The GPU path over NIXL (the shared suite; skipped without a CUDA device)."""

from __future__ import annotations

from aioembed.testing.gpu import CudaSuite


class TestCuda(CudaSuite):
    transport_name = "nixl"
    transport_options = {"write_timeout": 10.0}
