"""Over Mooncake TCP, two processes: a receiver SIGSTOPped long enough to be declared dead while the
sender's write into its pool is in flight, then resumed. The late write lands in the blocks it was
announced for (fenced meanwhile), the next room is served into the other blocks and its lease stays
intact, and the fenced blocks come back once the sender confirms its write ended (DRAINED)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from aioembed import EmbeddingSender, PeerDead, TransferError
from aioembed.samples import deterministic_request

sys.path.insert(0, str(Path(__file__).parent))
from frozen_receiver_proc import A_TOKENS, B_TOKENS, CONFIG, LAYOUT
from procstate import is_stopped

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_frozen_receiver_resumed_after_being_declared_dead() -> None:
    errors: dict[str, BaseException] = {}
    async with EmbeddingSender(LAYOUT, CONFIG) as sender:
        proc = await anyio.open_process([sys.executable, str(Path(__file__).with_name("frozen_receiver_proc.py")),
                                         sender.address], stderr=subprocess.DEVNULL)
        buffer = b""

        async def event() -> dict[str, Any]:
            nonlocal buffer
            assert proc.stdout is not None
            while b"\n" not in buffer:
                buffer += await proc.stdout.receive()
            line, buffer = buffer.split(b"\n", 1)
            return dict(json.loads(line))

        try:
            with anyio.fail_after(120):
                started = await event()  # after the side process's start-up, never raced
                assert started == {"event": "a_started", "blocks": 157}, started
                while sender.rooms_in_flight < 1:
                    await anyio.sleep(0.01)
                os.kill(proc.pid, signal.SIGSTOP)
                while not is_stopped(proc.pid):
                    await anyio.sleep(0.001)

                async def send(room: str, tokens: int) -> None:
                    try:
                        await sender.send(room, deterministic_request(LAYOUT, tokens, room))
                    except TransferError as exc:
                        errors[room] = exc

                async with anyio.create_task_group() as tg:
                    tg.start_soon(send, "A", A_TOKENS)
                    while sender.writes_in_flight < 1:
                        await anyio.sleep(0.01)
                    t0 = time.monotonic()
                    while sender.peers:  # declared dead while frozen, its write still in flight
                        await anyio.sleep(0.02)
                    assert time.monotonic() - t0 < 10 and sender.writes_in_flight == 1
                    os.kill(proc.pid, signal.SIGCONT)
                    tg.start_soon(send, "B", B_TOKENS)
                    a_ended = await event()
                    assert a_ended["event"] == "a_ended" and a_ended["kind"] == "PeerDead", a_ended
                    b_leased = await event()
                    assert b_leased["event"] == "b_leased", b_leased
                    result = await event()
                assert result["event"] == "result", result
                assert result["a_landed"], result  # the late write landed where it was announced
                assert result["released"].get("DRAINED", 0) == 157, result  # freed on the sender's word only
                assert result["overlap"] == 0 or result["released_before_b"] == 157, result  # never while fenced
                assert result["b_intact"], result  # its lease held across all of it: untouched
                assert result["pool_free"], result
                assert isinstance(errors.get("A"), PeerDead), errors
                assert "B" not in errors, errors
                await send("C", 500)
                assert (await event()) == {"event": "c", "ok": True}
        finally:
            if proc.returncode is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            await proc.wait()
