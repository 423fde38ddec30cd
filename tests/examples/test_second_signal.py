"""A second Ctrl-C / SIGTERM skips the wait for requests in flight (examples/README.md, "Stopping": "A second
signal stops at once"). The drains ran shielded (the encoder's again in its lifespan shutdown, both in the
in-process script's ``finally``), so a second signal changed nothing: the process still waited out the whole
5 s (encoder) or 10 + 5 s (in process) for a room nobody would ever receive."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import httpx
import pytest

from .conftest import ServerProcess, assert_clean_exit, clean_env, server_processes

pytestmark = pytest.mark.anyio

STOPPED_WITHIN = 3.0
"""Seconds from the second signal to the exit: well under the encoder's 5 s drain."""


@pytest.mark.parametrize(("script", "args"), [
    ("encoder_server.py", ["--config", "examples/config.loopback.toml", "--port", "0"]),
    ("disaggregated_inprocess.py", ["--port", "0", "--encoder-port", "0"]),
])
async def test_a_second_signal_aborts_the_rooms_in_flight_at_once(script: str, args: list[str],
                                                                 tmp_path: Path) -> None:
    from tiny_vit import test_pattern

    with server_processes() as procs:
        proc = ServerProcess("server", [script, *args], clean_env(), tmp_path)
        procs.append(proc)
        url = await proc.wait_ready()
        async with httpx.AsyncClient(timeout=30) as client:
            if script == "disaggregated_inprocess.py":
                url = proc.line(r"encoder (http://\S+)")
            # A room no language server receives: its send() waits input_timeout (60 s) for an INIT.
            resp = await client.post(f"{url}/encode", json={"room": "nobody-receives-it",
                                                            "image": test_pattern(100, 60).to_json()})
            assert resp.status_code == 202, resp.text
        await anyio.sleep(0.5)
        proc.process.send_signal(signal.SIGTERM)
        await anyio.sleep(0.5)
        assert proc.process.poll() is None  # the first signal waits for the room (up to 5 s)
        t0 = time.monotonic()
        proc.process.send_signal(signal.SIGTERM)
        code = await proc.wait_exit(timeout=30)
        took = time.monotonic() - t0
        assert_clean_exit(proc, code)
        assert took < STOPPED_WITHIN, f"exited {took:.1f} s after the second signal:\n{proc.stderr}"
