"""``LanguageService.generate`` when the receiver refuses a room or an encoder refuses an image.

A room the receiver refused at ``start()`` (``InvalidRequest``: a multi-image request over
``max_request_tokens``, ``chunk_tokens`` < 0, no connection free under ``max_senders``) escaped ``generate()``:
an HTTP 500 with a traceback, and the router counted the request's images as in flight on their encoders for
ever (it then sends every later image to the other encoders)."""

from __future__ import annotations

import anyio
import httpx
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferConfig

pytestmark = pytest.mark.anyio


async def test_a_room_the_receiver_refuses_is_a_400_and_frees_the_encoders() -> None:
    from language_server import Encoder, LanguageService
    from tiny_vit import LAYOUT, test_pattern

    config = TransferConfig(default_tokens=128, pool_tokens=4096, max_request_tokens=100)
    images = [test_pattern(224, 224, seed=i) for i in range(2)]  # 64 + 64 tokens > 100
    async with (EmbeddingSender(LAYOUT, config) as sender, EmbeddingReceiver(LAYOUT, config) as receiver,
                httpx.AsyncClient(timeout=10) as http):
        enc = Encoder("http://127.0.0.1:9", sender.address)  # never asked: the room is refused first
        service = LanguageService(receiver, http, [enc])
        status, body = await service.generate(images, [i.to_json() for i in images], "")
        assert status == 400, body
        assert "max_request_tokens=100" in body["error"]
        assert enc.in_flight == 0
        assert receiver.rooms_in_flight == 0


async def test_healthz_stays_ok_once_an_idle_connection_was_closed() -> None:
    """The receiver closes a connection with no room for ``sender_idle_timeout`` (300 s by default); /healthz
    asked only ``connected_to()``, so an idle language server answered 503 from then on, until a request came:
    a readiness probe takes it out of rotation after five quiet minutes, and then no request ever comes."""
    from disaggregated_inprocess import running_inprocess
    from tiny_vit import test_pattern

    config = TransferConfig(default_tokens=128, pool_tokens=4096, sender_idle_timeout=0.3)
    async with running_inprocess(config) as run, httpx.AsyncClient(timeout=30) as client:
        image = test_pattern(224, 224)
        resp = await client.post(f"{run.language_url}/generate", json={"image": image.to_json()})
        assert resp.status_code == 200, resp.text
        await anyio.sleep(1.0)  # the connection to the encoder is closed as idle meanwhile
        health = await client.get(f"{run.language_url}/healthz")
        assert health.status_code == 200 and health.json()["ok"], health.text
        resp = await client.post(f"{run.language_url}/generate", json={"image": image.to_json()})
        assert resp.status_code == 200, resp.text
