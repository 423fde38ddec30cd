"""``ProcessSide.ready``: a side process is ready only once it runs the event loop it was asked for, and one
that never gets there fails the test with what it wrote to stderr."""

from __future__ import annotations

import sys

import anyio
import pytest

from aioembed.testing.processes import ProcessSide, SideSpec, spawn

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _fake_side(script: str, backend: str) -> tuple[anyio.abc.Process, ProcessSide]:
    process = await anyio.open_process([sys.executable, "-c", script])
    return process, ProcessSide(process, name="send[0]", backend=backend)


@pytest.mark.parametrize("loop", ["uvloop", "trio"])
async def test_a_real_side_reports_the_loop_it_was_asked_for(loop: str) -> None:
    spec = SideSpec(role="send", config={"default_tokens": 1024, "pool_tokens": 4096}, rooms=[], backend=loop)
    async with spawn(spec) as side:
        ready = await side.ready(60)
    assert ready["loop"] == loop
    assert ready["address"].startswith("tcp://127.0.0.1:")


async def test_a_side_running_another_loop_than_asked_fails_naming_both() -> None:
    process, side = await _fake_side('print(\'{"event": "ready", "loop": "asyncio", "pid": 7}\', flush=True)',
                                     backend="uvloop")
    async with process:
        with pytest.raises(AssertionError, match=r"send\[0\] \(pid 7\) was asked to run uvloop and runs asyncio"):
            await side.ready(30)


async def test_a_side_that_ends_before_it_is_ready_fails_the_test() -> None:
    process, side = await _fake_side("raise SystemExit(3)", backend="asyncio")
    async with process:
        with pytest.raises(AssertionError, match=r"send\[0\] did not start: process \d+ ended \(code"):
            await side.ready(30)
