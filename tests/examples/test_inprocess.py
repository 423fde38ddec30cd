"""The disaggregated servers in one process on loopback: the HTTP round trip and the rows it yields."""

from __future__ import annotations

import base64
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from aioembed import TransferConfig

from .conftest import ServerProcess, assert_clean_exit, clean_env, server_processes

pytestmark = pytest.mark.anyio


async def _generate(client: httpx.AsyncClient, url: str, image: Any) -> dict[str, Any]:
    resp = await client.post(f"{url}/generate", json={"image": image.to_json(), "prompt": "describe"})
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


async def test_inprocess_servers_deliver_the_encoders_rows() -> None:
    from aioembed.samples import checksum

    from disaggregated_inprocess import running_inprocess
    from tiny_vit import HIDDEN, MODEL_NAME, build_model, encode, test_pattern

    config = TransferConfig(default_tokens=128, pool_tokens=4096)
    model = build_model()
    async with running_inprocess(config) as run, httpx.AsyncClient(timeout=60) as client:
        for url in (run.encoder_url, run.language_url):
            health = await client.get(f"{url}/healthz")
            assert health.status_code == 200 and health.json()["ok"], health.text
        assert (await client.get(f"{run.encoder_url}/healthz")).json()["control_address"] == run.control_address

        small, large = test_pattern(224, 224, seed=1), test_pattern(448, 336, seed=2)
        first = await _generate(client, run.language_url, small)
        assert first["tokens"] == 64 == small.num_tokens  # (224/28)^2 merged 2x2 patches
        assert first["rounds"] == 1
        assert first["bytes"] == 64 * (HIDDEN * 2 + 4 + 3 * 8)
        assert first["embedding"]["shape"] == [64, HIDDEN] and first["embedding"]["dtype"] == "bfloat16"
        assert first["embedding"]["finite"] and first["embedding"]["std"] > 0
        assert first["image_pad_tokens"] == 64
        assert first["mrope_grid"] == [1, 8, 8]
        meta = first["metadata"]
        assert meta["model"] == MODEL_NAME and meta["image_size"] == [224, 224] and meta["grid_thw"] == [1, 8, 8]
        assert set(first["seconds"]) >= {"request", "transfer", "handshake", "allocate", "wait", "copy"}
        # The rows that arrived are exactly what the encoder computes for this image.
        assert first["sha256"] == checksum(encode(model, small))

        second = await _generate(client, run.language_url, large)
        assert second["tokens"] == 192 and second["rounds"] == 2  # over the 128-token reservation: resumed
        # streamed in chunks as the rows landed: every token once, the first chunk before the last byte
        assert sum(second["chunks"]) == 192 and len(second["chunks"]) >= 2
        assert second["streamed_image_pad_tokens"] == 192
        assert 0 < second["first_chunk_seconds"] <= second["last_byte_seconds"]
        assert second["mrope_grid"] == [1, 12, 16]
        assert second["sha256"] == checksum(encode(model, large))

        # The same image again: a new room, the same rows. Three at once: all served.
        again = [await _generate(client, run.language_url, small)]

        async def one() -> None:
            again.append(await _generate(client, run.language_url, small))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(one)
        assert {r["sha256"] for r in again} == {first["sha256"]}
        assert len({r["room"] for r in [first, *again]}) == 5

        # Bad input is refused before any room is opened.
        bad = small.to_json() | {"width": 225}
        resp = await client.post(f"{run.language_url}/generate", json={"image": bad})
        assert resp.status_code == 400 and "RGB bytes" in resp.json()["error"]
        resp = await client.post(f"{run.language_url}/generate", json={"image": {"width": 1, "height": 1,
                                                                               "rgb": "%%%"}})
        assert resp.status_code == 400
        resp = await client.post(f"{run.encoder_url}/encode", content=b"not json")
        assert resp.status_code == 400
        resp = await client.post(f"{run.encoder_url}/encode",
                                 json={"room": "p", "image": small.to_json(), "part": 4096})
        assert resp.status_code == 400 and "part must be an integer in [0, 4096)" in resp.json()["error"]

        health = (await client.get(f"{run.language_url}/healthz")).json()
        assert health["served"] == 6 and health["rooms_in_flight"] == 0
        assert health["pool_blocks"]["free"] == health["pool_blocks"]["total"]
        with anyio.fail_after(10):  # the encoder's send() returns a moment after the rows landed
            while (await client.get(f"{run.encoder_url}/healthz")).json()["rooms_in_flight"]:
                await anyio.sleep(0.02)
        assert (await client.get(f"{run.encoder_url}/healthz")).json()["sent"] == 6


async def test_inprocess_demo_script(tmp_path: Path) -> None:
    """``--demo`` with the loopback config file: three sizes, the largest resumes, exit 0."""
    with server_processes() as procs:
        procs.append(ServerProcess("demo", ["disaggregated_inprocess.py", "--demo", "--config",
                                            "examples/config.loopback.toml", "--port", "0", "--encoder-port", "0"],
                                   clean_env(), tmp_path))
        with anyio.fail_after(60):
            while procs[0].process.poll() is None:
                await anyio.sleep(0.05)
        out = procs[0].stdout
        assert procs[0].process.returncode == 0, out + procs[0].stderr
        assert "transport=loopback, default_tokens=1024" in out
        assert "224x224: 64 tokens in 1 round(s)" in out
        assert "1344x896: 1536 tokens in 2 round(s)" in out
        assert "Traceback" not in procs[0].stderr


async def test_inprocess_default_config_serves_until_sigint(tmp_path: Path) -> None:
    """No config and no environment: the embedded default (loopback); Ctrl-C stops it cleanly."""
    from tiny_vit import test_pattern

    with server_processes() as procs:
        proc = ServerProcess("inprocess", ["disaggregated_inprocess.py", "--port", "0", "--encoder-port", "0"],
                             clean_env(), tmp_path)
        procs.append(proc)
        url = await proc.wait_ready()
        assert "transport=loopback, default_tokens=8192" in proc.stdout
        async with httpx.AsyncClient(timeout=60) as client:
            image = test_pattern(100, 60)
            body = await _generate(client, url, image)
            assert body["tokens"] == 8 == image.num_tokens  # 100x60 rounds to 112x56: 4x2 tokens
            assert base64.b64decode(image.to_json()["rgb"]) == image.rgb
        assert_clean_exit(proc, await proc.stop(signal.SIGINT))
