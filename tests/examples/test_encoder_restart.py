"""An encoder restarted on the default ``--bind`` (port 0) listens on another control port. The language server
asked the control address once, at startup: every later room named the dead address, waited
``handshake_timeout`` and failed with 504 (while the new encoder's ``send()`` waited ``input_timeout`` for an
``INIT``), and ``/healthz`` said 503, until the language server itself was restarted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import anyio
import httpx
import pytest

from aioembed.testing.ports import fixed_port

from .conftest import ServerProcess, assert_clean_exit, clean_env, server_processes

pytestmark = pytest.mark.anyio


async def test_a_restarted_encoder_on_a_new_control_port_is_served_again(tmp_path: Path) -> None:
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("the mooncake transport is not installed")
    from tiny_vit import test_pattern

    port = fixed_port()
    encoder_args = ["encoder_server.py", "--config", "examples/config.mooncake.toml", "--port", str(port)]
    with server_processes() as procs:
        first = ServerProcess("encoder-1", encoder_args, clean_env(), tmp_path)
        procs.append(first)
        encoder_url = await first.wait_ready()
        old_control = first.line(r"control address (tcp://\S+)")
        language = ServerProcess("language", ["language_server.py", "--config", "examples/config.mooncake.toml",
                                              "--port", "0", "--encoder-url", encoder_url],
                                 clean_env(), tmp_path)
        procs.append(language)
        language_url = await language.wait_ready()
        image = test_pattern(224, 224)
        async with httpx.AsyncClient(timeout=60) as client:
            resp = await client.post(f"{language_url}/generate", json={"image": image.to_json()})
            assert resp.status_code == 200, resp.text

            assert_clean_exit(first, await first.stop())
            second = ServerProcess("encoder-2", encoder_args, clean_env(), tmp_path)
            procs.append(second)
            await second.wait_ready()
            new_control = second.line(r"control address (tcp://\S+)")
            assert new_control != old_control
            await anyio.sleep(6)  # the receiver's heartbeats to the first encoder have stopped (5 x 1 s)

            resp = await client.post(f"{language_url}/generate", json={"image": image.to_json()})
            assert resp.status_code == 200, resp.text
            health = await client.get(f"{language_url}/healthz")
            assert health.status_code == 200, health.text
            assert health.json()["encoders"][0]["control_address"] == new_control
        assert_clean_exit(language, await language.stop())
        assert_clean_exit(second, await second.stop())
