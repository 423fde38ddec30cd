"""The public lifecycle: a receiver or sender runs once, on the event loop that entered it.

* Entering one again (after its close, or while it runs: a nested ``async with``) opened a second transport
  endpoint (the pool registered again; a sender bound its address again) and a second ZeroMQ context with its
  sockets, and nothing ever closed them: the second ``__aexit__`` / ``aclose()`` was a no-op.
* A call from another thread's event loop spawned tasks into the owner's task group from the wrong thread and
  waited on its events from another loop: the room timed out after ``input_timeout`` with a misleading
  ``TransferTimeout`` (blocks fenced), instead of being refused at once.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import anyio
import pytest
import torch

from aioembed import AioembedError, EmbeddingReceiver, EmbeddingSender, Field, Layout, TransferConfig
from aioembed.transports import registry

pytestmark = pytest.mark.anyio

LAYOUT = Layout(e=Field((4,), torch.float32))
CFG = TransferConfig(pool_tokens=1024, default_tokens=256, staging_tokens=0, input_timeout=3, handshake_timeout=2)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every transport endpoint the sides open by name."""
    endpoints: list[Any] = []
    real = registry.open_transport

    async def spy(name: str, options: Mapping[str, Any] | None = None) -> Any:
        t = await real(name, options)
        endpoints.append(t)
        return t

    monkeypatch.setattr(registry, "open_transport", spy)  # what the sides' open_configured() calls
    return endpoints


def _side(kind: str) -> Any:
    if kind == "receiver":
        return EmbeddingReceiver(LAYOUT, CFG, connect="tcp://127.0.0.1:9")
    return EmbeddingSender(LAYOUT, CFG, bind="tcp://127.0.0.1:0")


@pytest.mark.parametrize("kind", ["receiver", "sender"])
async def test_a_closed_side_cannot_be_entered_again(kind: str, opened: list[Any]) -> None:
    side = _side(kind)
    async with side:
        pass
    with pytest.raises(AioembedError, match=r"closed already: .* runs once"):
        async with side:
            pass
    assert len(opened) == 1 and all(t.inner.closed for t in opened)  # no second endpoint left open
    assert side._ctx is None


@pytest.mark.parametrize("kind", ["receiver", "sender"])
async def test_a_running_side_cannot_be_entered_twice(kind: str, opened: list[Any]) -> None:
    side = _side(kind)
    async with side:
        with pytest.raises(AioembedError, match=r"entered already: .* runs once"):
            await side.__aenter__()
        assert len(opened) == 1
    assert all(t.inner.closed for t in opened)
    assert side._ctx is None


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_receiver_called_from_another_threads_loop_is_refused_at_once() -> None:
    """The receiver runs in this loop; another thread's loop calls receive(): refused at once, nothing started."""
    async with EmbeddingSender(LAYOUT, CFG, bind="tcp://127.0.0.1:0") as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address) as receiver:
        got: list[BaseException] = []

        def other_loop() -> None:
            async def call() -> None:
                with anyio.fail_after(10):
                    await receiver.receive("x")

            try:
                anyio.run(call)
            except BaseException as exc:
                got.append(exc)

        t = threading.Thread(target=other_loop)
        t.start()
        await anyio.to_thread.run_sync(t.join)
        assert len(got) == 1 and isinstance(got[0], AioembedError), got
        assert "another thread" in str(got[0])
        assert receiver.rooms_in_flight == 0
        assert receiver.allocator.stats.free == receiver.allocator.stats.total
