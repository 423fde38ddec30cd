"""The GPU path over Mooncake (the shared suite; skipped without a CUDA device or a CUDA build)."""

from __future__ import annotations

from aioembed.testing.gpu import CudaSuite


class TestCuda(CudaSuite):
    transport_name = "mooncake"
    transport_options = {"protocol": "tcp", "hostname": "127.0.0.1"}
