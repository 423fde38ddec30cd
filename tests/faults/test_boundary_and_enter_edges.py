"""Edges of the boundary and of the run-once lifecycle: a stray CancelledError from ``reads_unregistered()``, and the
message of an ``__aenter__`` after one that failed."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from aioembed import EmbeddingSender, Field, Layout, TransferConfig
from aioembed.errors import AioembedError
from aioembed.testing import MockTransport

pytestmark = pytest.mark.anyio

LAYOUT = Layout(e=Field((64,), torch.float32))
CFG = TransferConfig(pool_tokens=4096, default_tokens=1024, staging_tokens=0, status_inline_bytes=0,
                     input_timeout=5, round_timeout=5, room_timeout=10)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # a stray asyncio.CancelledError is an asyncio thing


class _CannotSay(MockTransport):
    """A plugin whose reads_unregistered() reads a future its engine cancelled (``fut.result()``: synchronous)."""

    def reads_unregistered(self, device: str) -> bool:
        fut = asyncio.get_running_loop().create_future()
        fut.cancel("the engine's capability probe was cancelled")
        return bool(fut.result())


async def test_reads_unregistered_that_raises_a_cancelled_error_means_register_the_sources() -> None:
    """The boundary's reads_unregistered() is "never an exception" (False and a warning), but it catches Exception
    only: an asyncio.CancelledError out of the plugin's synchronous call (a cancelled future's result()) escaped it
    raw, out of send() and out of ``async with EmbeddingSender`` (staging), as if the caller had been cancelled."""
    from aioembed.transports.boundary import guard
    transport = guard(_CannotSay())
    assert transport.reads_unregistered("cpu") is False


async def test_a_sender_whose_enter_failed_says_so() -> None:
    """``__aenter__`` marks the sender entered before anything can fail: a bind that failed (address in use) makes
    every later use say "entered already", as if it ran."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    sender = EmbeddingSender(LAYOUT, CFG, bind=f"tcp://127.0.0.1:{port}", transport=MockTransport())
    with pytest.raises(Exception) as first:
        await sender.__aenter__()
    assert not isinstance(first.value, AioembedError) or "entered already" not in str(first.value)
    busy.close()
    with pytest.raises(AioembedError) as second:
        await sender.__aenter__()
    assert "failed" in str(second.value), second.value  # not "entered already", as if it had run
