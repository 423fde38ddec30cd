"""The side-process harness watches its own event loop: a side whose loop stops writes every thread's
stack to its kept stderr (``faulthandler``, no loop and no GIL needed), and ``loop_stops`` finds it."""

from __future__ import annotations

import pytest

from aioembed.testing.processes import SideSpec, loop_stops, spawn

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_side_whose_loop_stops_writes_every_threads_stack_to_its_kept_stderr() -> None:
    cfg = {"default_tokens": 1024, "pool_tokens": 4096}
    spec = SideSpec(role="send", config=cfg, rooms=[], env={"AIOEMBED_TEST_BLOCK_LOOP": "4.5"})
    async with spawn(spec) as sender:
        await sender.until("ready", timeout=60)
        logs = sender.stderr_tail(lines=200)
        assert loop_stops(sender).startswith("--- send[0]"), loop_stops(sender)
    assert "Timeout (0:00:03)!" in logs, logs  # faulthandler's dump, 3 s into the 4.5 s block
    assert "in _run_role" in logs, logs  # the stack of the blocked loop's thread
