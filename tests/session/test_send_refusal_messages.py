"""The sender: a request ``send()`` refuses says which room it was (a server sends many at once, and the
error is often logged far from the call), as every other refusal of ``send()`` does."""

from __future__ import annotations

import pytest
import torch

from aioembed import EmbeddingSender, InvalidRequest, LayoutError, TransferConfig
from aioembed.testing import MockTransport

from .conftest import LAYOUT, make_request, running

pytestmark = pytest.mark.anyio

FAST = TransferConfig(default_tokens=1024, pool_tokens=4096, handshake_timeout=2.0, input_timeout=2.0)


async def test_tensors_that_do_not_match_the_layout_are_refused_naming_the_room() -> None:
    async with running(FAST) as (sender, [_receiver]):
        good = make_request(10, 6)
        with pytest.raises(LayoutError, match=r"room 'img-17'.*token_ids"):
            await sender.send("img-17", dict(good, token_ids=good["token_ids"].to(torch.int64)))
        with pytest.raises(LayoutError, match=r"room \('img-18', 1\).*tokens"):
            await sender.send("img-18", dict(good, token_ids=good["token_ids"][:5]), part=1)


async def test_a_field_on_a_device_the_transport_does_not_move_names_the_transport_in_use() -> None:
    """The refusal names the transport the sender writes with: an injected endpoint (``transport=``), not
    ``config.transport``, which was never opened (it named ``'loopback'`` for a sender writing over another one)."""
    async with EmbeddingSender(LAYOUT, FAST, transport=MockTransport()) as sender:
        bad = dict(make_request(10, 1), embeddings=torch.empty(10, *LAYOUT["embeddings"].shape,
                                                                dtype=LAYOUT["embeddings"].dtype, device="meta"))
        with pytest.raises(InvalidRequest, match=r"room 'r': field 'embeddings' is on meta; transport 'mock' moves "
                                                 r"CPU memory only"):
            await sender.send("r", bad)
