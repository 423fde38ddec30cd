"""Refuse transport / event-loop / device combinations that cannot work, before any I/O."""

from __future__ import annotations

import sniffio
import torch

from aioembed.errors import ConfigError
from aioembed.transports.base import Transport

__all__ = ["check_backend"]


def check_backend(transport: Transport, device: torch.device) -> None:
    """Raise ``ConfigError`` if ``transport`` cannot run on this event loop or reach ``device``."""
    caps = transport.capabilities
    if caps.asyncio_only:
        lib = sniffio.current_async_library()
        if lib != "asyncio":
            raise ConfigError(
                f"transport {transport.name!r} works only under asyncio, but this code runs under {lib}; "
                "use the loopback or mooncake transport, or run under asyncio"
            )
    if device.type == "cuda" and not caps.cuda:
        raise ConfigError(f"transport {transport.name!r} cannot register CUDA memory (device={device}); "
                          "use device='cpu' or a CUDA-capable transport")
