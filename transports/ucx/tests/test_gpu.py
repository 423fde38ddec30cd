"""The GPU path over UCX (the shared suite; skipped without a CUDA device)."""

from __future__ import annotations

from aioembed.testing.gpu import CudaSuite


class TestCuda(CudaSuite):
    transport_name = "ucx"
    transport_options = {"tls": "tcp,cuda_copy,cuda_ipc", "host": "127.0.0.1"}
