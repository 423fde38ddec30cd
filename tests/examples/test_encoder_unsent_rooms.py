"""An encoder's room that never reaches ``send()``: its encode failed, or the drain cancelled it while it waited
for the model behind another image. The language side asked for the room before the encoder answered 202, and
only a ``send()`` (or an ``abort()``) ends it on the sender: the encoder logged the failure and the language
server's request waited its whole ``input_timeout`` (60 s by default) for rows that never came, then answered
504 "timed out in phase 'input'" instead of a prompt 502 naming the failure."""

from __future__ import annotations

import anyio
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferAborted, TransferConfig

pytestmark = pytest.mark.anyio

CONFIG = TransferConfig(default_tokens=128, pool_tokens=4096, input_timeout=60.0)
TOLD_WITHIN = 10.0
"""Seconds for the language side to learn that the room ended: far under ``input_timeout``."""


def _failing_encode(model: object, image: object) -> object:
    raise RuntimeError("CUDA out of memory (simulated)")


async def test_a_failed_encode_aborts_the_room_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import encoder_server
    from tiny_vit import LAYOUT, build_model, test_pattern

    monkeypatch.setattr(encoder_server, "encode", _failing_encode)
    async with (EmbeddingSender(LAYOUT, CONFIG) as sender,
                EmbeddingReceiver(LAYOUT, CONFIG, connect=sender.address) as receiver):
        service = encoder_server.EncoderService(sender, build_model(0))
        async with service.running():
            handle = receiver.start("room-1")
            service.submit("room-1", test_pattern(224, 224), {})
            with anyio.fail_after(TOLD_WITHIN), pytest.raises(TransferAborted, match="CUDA out of memory"):
                await handle.result()
        assert service.failed == 1 and not service.in_flight


async def test_a_room_cancelled_while_it_waits_for_the_model_is_aborted_at_once() -> None:
    import encoder_server
    from tiny_vit import LAYOUT, build_model, test_pattern

    async with (EmbeddingSender(LAYOUT, CONFIG) as sender,
                EmbeddingReceiver(LAYOUT, CONFIG, connect=sender.address) as receiver):
        service = encoder_server.EncoderService(sender, build_model(0), drain_seconds=0)
        async with service.running():
            handle = receiver.start("room-1")
            async with service.limiter:  # another image's forward pass holds the model
                service.submit("room-1", test_pattern(224, 224), {})
                await service.drain()  # cancels the room still queued for the model
            with anyio.fail_after(TOLD_WITHIN), pytest.raises(TransferAborted, match="shutting down"):
                await handle.result()
        assert service.failed == 1
