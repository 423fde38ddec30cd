"""Two processes need a cross-process transport; loopback must refuse clearly, not hang."""

from __future__ import annotations

import anyio
import pytest

from aioembed.testing.processes import RoomSpec, SideSpec, side_logs, spawn

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_loopback_across_processes_is_refused_with_a_clear_error() -> None:
    cfg = {"default_tokens": 1024, "pool_tokens": 4096, "handshake_timeout": 0.5}
    async with spawn(SideSpec(role="send", config=cfg, rooms=[RoomSpec("r", 100)])) as sender:
        ready = await sender.until("ready")
        spec = SideSpec(role="receive", config=cfg, rooms=[RoomSpec("r", 100)], connect=ready["address"])
        async with spawn(spec) as receiver:
            with pytest.raises(EOFError):
                await receiver.until("ready", timeout=30)
            # the receiver failed its handshake: the sender refused the loopback descriptor
            with anyio.fail_after(30):
                assert await receiver.process.wait() != 0
            # and its stderr, kept for the test, says so (with the side's name)
            logs = side_logs(receiver)
            assert logs.startswith(f"--- receive[0] (pid {receiver.pid}) stderr:"), logs
            assert "loopback" in receiver.stderr_tail(), logs
