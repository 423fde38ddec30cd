"""The language server's ``/healthz`` with several encoders down. It probed the encoders one after the other,
each unreachable one waiting a second for a handshake: with six down the answer took six seconds, past any
readiness probe's timeout (Kubernetes: 1 s by default), so the probe timed out instead of reading which
encoders were down. The probes run at once: one second, whatever the number of encoders."""

from __future__ import annotations

import time

import httpx
import pytest

from aioembed import EmbeddingReceiver, TransferConfig

pytestmark = pytest.mark.anyio

ANSWERED_WITHIN = 3.5
"""Seconds: one probe's second, with room for a busy host; six probes in a row took over 6."""


async def test_healthz_probes_the_encoders_at_once() -> None:
    from language_server import Encoder, LanguageService, build_app
    from tiny_vit import LAYOUT

    config = TransferConfig(default_tokens=128, pool_tokens=4096)
    async with EmbeddingReceiver(LAYOUT, config) as receiver, httpx.AsyncClient() as http:
        # Closed ports: the receiver's connections there never shake hands.
        encoders = [Encoder("http://127.0.0.1:9", f"tcp://127.0.0.1:{port}") for port in range(1, 7)]
        app = build_app(LanguageService(receiver, http, encoders))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://language") as client:
            t0 = time.monotonic()
            health = await client.get("/healthz", timeout=30)
            took = time.monotonic() - t0
    assert health.status_code == 503, health.text
    assert [e["connected"] for e in health.json()["encoders"]] == [False] * 6
    assert [e["control_address"] for e in health.json()["encoders"]] == [e.control for e in encoders]
    assert took < ANSWERED_WITHIN, f"/healthz answered after {took:.1f} s"
