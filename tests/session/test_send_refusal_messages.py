"""The sender: a request ``send()`` refuses says which room it was (a server sends many at once, and the
error is often logged far from the call), as every other refusal of ``send()`` does."""

from __future__ import annotations

import pytest
import torch

from aioembed import LayoutError, TransferConfig

from .conftest import make_request, running

pytestmark = pytest.mark.anyio

FAST = TransferConfig(default_tokens=1024, pool_tokens=4096, handshake_timeout=2.0, input_timeout=2.0)


async def test_tensors_that_do_not_match_the_layout_are_refused_naming_the_room() -> None:
    async with running(FAST) as (sender, [_receiver]):
        good = make_request(10, 6)
        with pytest.raises(LayoutError, match=r"room 'img-17'.*token_ids"):
            await sender.send("img-17", dict(good, token_ids=good["token_ids"].to(torch.int64)))
        with pytest.raises(LayoutError, match=r"room \('img-18', 1\).*tokens"):
            await sender.send("img-18", dict(good, token_ids=good["token_ids"][:5]), part=1)
