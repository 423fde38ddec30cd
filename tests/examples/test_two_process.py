"""encoder_server and language_server as two processes over a cross-process transport, as in the README."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from .conftest import ServerProcess, assert_clean_exit, clean_env, server_processes

pytestmark = pytest.mark.anyio

# transport -> (module its plugin needs, AIOEMBED_TRANSPORT_OPTIONS for the language server)
TRANSPORTS = {
    "mooncake": ("mooncake", '{protocol = "tcp", hostname = "127.0.0.1"}'),
    "ucx": ("ucxx", '{tls = "tcp", host = "127.0.0.1"}'),
}
SIZES = [(100, 60, 8, 1), (224, 224, 64, 1), (672, 448, 384, 2)]  # width, height, tokens, rounds


@pytest.mark.parametrize("transport", list(TRANSPORTS))
async def test_two_processes(transport: str, tmp_path: Path) -> None:
    module, options = TRANSPORTS[transport]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"the {transport} transport needs {module!r}, not installed")
    from aioembed.samples import checksum

    from tiny_vit import build_model, encode, test_pattern

    with server_processes() as procs:
        # The encoder reads the transport from the example config file ...
        encoder = ServerProcess("encoder", ["encoder_server.py", "--config", f"examples/config.{transport}.toml",
                                            "--port", "0"], clean_env(), tmp_path)
        procs.append(encoder)
        encoder_url = await encoder.wait_ready()
        control = encoder.line(r"control address (tcp://\S+)")
        # ... the language server from the environment, with a 128-token first reservation so
        # that the largest image (384 tokens) needs a resume round.
        env = clean_env(AIOEMBED_TRANSPORT=transport, AIOEMBED_TRANSPORT_OPTIONS=options,
                        AIOEMBED_DEFAULT_TOKENS="128", AIOEMBED_POOL_TOKENS="4096")
        language = ServerProcess("language", ["language_server.py", "--port", "0", "--encoder-url", encoder_url],
                                 env, tmp_path)
        procs.append(language)
        # Meanwhile, a language server left on loopback (no config) cannot use this encoder: it
        # must say so and exit 1, not hang or print a traceback (checked once, to save time).
        wrong = None
        if transport == "mooncake":
            wrong = ServerProcess("wrong", ["language_server.py", "--port", "0", "--control-address", control],
                                  clean_env(), tmp_path)
            procs.append(wrong)
        language_url = await language.wait_ready()
        assert f"receiving from {control}" in language.stdout

        model = build_model()
        async with httpx.AsyncClient(timeout=60) as client:
            health = await client.get(f"{language_url}/healthz")
            assert health.status_code == 200 and health.json()["transport"] == transport, health.text
            health = await client.get(f"{encoder_url}/healthz")
            assert health.status_code == 200 and health.json()["peers"] == 1, health.text

            async def generate(image: Any) -> dict[str, Any]:
                resp = await client.post(f"{language_url}/generate", json={"image": image.to_json()})
                assert resp.status_code == 200, resp.text
                body: dict[str, Any] = resp.json()
                return body

            for i, (w, h, tokens, rounds) in enumerate(SIZES):
                image = test_pattern(w, h, seed=i)
                body = await generate(image)
                assert (body["tokens"], body["rounds"]) == (tokens, rounds), body
                assert body["metadata"]["image_size"] == [w, h]
                assert body["image_pad_tokens"] == tokens
                assert body["sha256"] == checksum(encode(model, image))  # bit for bit, across processes

            image = test_pattern(224, 224, seed=1)
            results: list[dict[str, Any]] = []

            async def one() -> None:
                results.append(await generate(image))

            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(one)
            assert len({r["sha256"] for r in results}) == 1 and len({r["room"] for r in results}) == 3

            # The language side answers once the rows landed; the encoder's send() returns a moment later.
            with anyio.fail_after(10):
                while (stats := (await client.get(f"{encoder_url}/healthz")).json())["rooms_in_flight"]:
                    await anyio.sleep(0.02)
            assert (stats["sent"], stats["failed"], stats["rooms_in_flight"]) == (6, 0, 0)
            pool = (await client.get(f"{language_url}/healthz")).json()["pool_blocks"]
            assert pool["free"] == pool["total"]

            if wrong is not None:
                with anyio.fail_after(30):
                    while wrong.process.poll() is None:
                        await anyio.sleep(0.05)
                assert wrong.process.returncode == 1, wrong.stderr
                assert "language_server: error:" in wrong.stderr and "Traceback" not in wrong.stderr
                assert f"transport 'loopback' != sender's '{transport}'" in wrong.stderr

            # Stop both while a request is in flight: each side drains before it closes, so the
            # request is answered in full, then both exit 0 without a traceback.
            big = test_pattern(1344, 896, seed=9)
            late: list[dict[str, Any]] = []

            async def in_flight() -> None:
                late.append(await generate(big))

            async with anyio.create_task_group() as tg:
                tg.start_soon(in_flight)
                with anyio.fail_after(20):
                    # once the encoder has accepted the room (before that, it would refuse it: 503)
                    while not late and (await client.get(f"{encoder_url}/healthz")).json()["rooms_in_flight"] == 0:
                        await anyio.sleep(0.01)
                language.process.send_signal(signal.SIGTERM)
                encoder.process.send_signal(signal.SIGINT)
            assert late[0]["tokens"] == big.num_tokens == 1536 and late[0]["rounds"] == 2
            # a long request, consumed in chunks of 256 tokens as they landed (a chunked prefill's view)
            assert sum(late[0]["chunks"]) == 1536 and max(late[0]["chunks"]) <= 256 and len(late[0]["chunks"]) >= 6
            assert late[0]["first_chunk_seconds"] < late[0]["last_byte_seconds"]

        for proc in (language, encoder):
            assert_clean_exit(proc, await proc.wait_exit())


async def test_two_encoders_one_language_server(tmp_path: Path) -> None:
    """The deployment shape of the examples: one language server (one pool) and two encoders; the router
    spreads images over both, and a multi-image request is one room assembled from parts."""
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("the mooncake transport is not installed")
    import torch

    from aioembed.samples import checksum

    from tiny_vit import build_model, encode, test_pattern

    with server_processes() as procs:
        encoders = []
        for name in ("encoder-a", "encoder-b"):
            proc = ServerProcess(name, ["encoder_server.py", "--config", "examples/config.mooncake.toml",
                                        "--port", "0"], clean_env(), tmp_path)
            procs.append(proc)
            encoders.append(proc)
        urls = [await e.wait_ready() for e in encoders]
        args = ["language_server.py", "--config", "examples/config.mooncake.toml", "--port", "0"]
        for url in urls:
            args += ["--encoder-url", url]
        language = ServerProcess("language", args, clean_env(), tmp_path)
        procs.append(language)
        language_url = await language.wait_ready()
        model = build_model()
        async with httpx.AsyncClient(timeout=60) as client:
            health = (await client.get(f"{language_url}/healthz")).json()
            assert health["ok"] and [e["connected"] for e in health["encoders"]] == [True, True], health

            # single images: the router alternates while nothing is in flight
            used = []
            for i in range(4):
                image = test_pattern(224, 224, seed=i)
                resp = await client.post(f"{language_url}/generate", json={"image": image.to_json()})
                assert resp.status_code == 200, resp.text
                body = resp.json()
                assert body["sha256"] == checksum(encode(model, image))
                used += body["encoders"]
            assert sorted(set(used)) == sorted(urls)

            # a multi-image request: one room, its images encoded by both encoders, rows in image order
            images = [test_pattern(672, 448, seed=7), test_pattern(224, 224, seed=8), test_pattern(100, 60, seed=9)]
            resp = await client.post(f"{language_url}/generate", json={"images": [im.to_json() for im in images]})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            rows = [encode(model, im) for im in images]
            whole = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
            assert body["tokens"] == sum(im.num_tokens for im in images) == 384 + 64 + 8
            assert body["sha256"] == checksum(whole)  # bit for bit, assembled from two processes
            assert set(body["encoders"]) == set(urls)
            assert [m["image_size"] for m in body["part_metadata"]] == [[672, 448], [224, 224], [100, 60]]

            pool = (await client.get(f"{language_url}/healthz")).json()["pool_blocks"]
            assert pool["free"] == pool["total"]
        for proc in (language, *encoders):
            assert_clean_exit(proc, await proc.stop())
