"""A ``stream()`` refused at its start (``InvalidRequest``: no sender named, a room id whose earlier attempt is not
settled, no connection free under ``max_senders``) leaves nothing open. Its chunk stream was made before the
checks that refuse it, and was left unclosed: anyio warns of each such stream (``ResourceWarning``) when it is
collected, two per refused call."""

from __future__ import annotations

import gc
import warnings

import pytest

from aioembed import EmbeddingReceiver, InvalidRequest, TransferConfig

from .conftest import LAYOUT

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copied", "zero-copy"])
async def test_a_refused_stream_leaves_no_chunk_stream_open(zero_copy: bool) -> None:
    cfg = TransferConfig(default_tokens=256, pool_tokens=1024)
    async with EmbeddingReceiver(LAYOUT, cfg) as receiver:  # no default sender
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with pytest.raises(InvalidRequest, match="no sender named"):
                    receiver.stream("r", zero_copy=zero_copy)
            gc.collect()
        unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert not unclosed, unclosed
        assert receiver.rooms_in_flight == 0
