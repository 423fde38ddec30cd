"""A CUDA pool's copies out run on one private stream, and each waits for the stream it ran on.

``RoundCopier`` copies in worker threads (``copy_threads`` at once). Its private stream was made lazily inside
those threads: two copies starting together each saw none, each made one and stored it, and each read the
attribute again for its ``wait_stream``, its copy and its fence; one copy could then run on one stream and wait
for the other's event, so the round's blocks went back to the pool while the copy still read them. CUDA is faked
here (streams, the stream context, the fence, the pool's copy), so that the interleaving is forced, without a GPU.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

from aioembed.session import copy_out
from aioembed.session.copy_out import RoundCopier

pytestmark = pytest.mark.anyio


class _Streams:
    """Fake ``torch.cuda.Stream``s. Made off the loop's thread by two copies starting together, the interleaving
    that loses a copy's stream is forced: the first stream is made once the second copy found none either, and
    the second only once the first copy queued its ``wait_stream`` (on the stream it had just stored), which
    returns once the second copy stored its own and queued its ``wait_stream`` too."""

    def __init__(self, loop_thread: int) -> None:
        self.made: list[object] = []
        self.loop_thread = loop_thread
        self.second_made = threading.Event()
        self.first_waiting = threading.Event()
        self.second_waiting = threading.Event()
        self.current = threading.local()
        self.waited_after: dict[int, object] = {}
        self.copied_on: dict[int, object] = {}
        self.fenced_on: dict[int, object] = {}
        self.lock = threading.Lock()

    def stream_class(self) -> type:
        streams = self

        class Stream:
            def __init__(self, device: object = None) -> None:
                with streams.lock:
                    streams.made.append(self)
                    n = len(streams.made)
                if threading.get_ident() == streams.loop_thread:
                    return
                if n == 1:
                    streams.second_made.wait(timeout=5)
                else:
                    streams.second_made.set()
                    streams.first_waiting.wait(timeout=5)

            def wait_stream(self, other: object) -> None:
                streams.waited_after[threading.get_ident()] = self
                with streams.lock:
                    first = not streams.first_waiting.is_set()
                    (streams.first_waiting if first else streams.second_waiting).set()
                if first:
                    streams.second_waiting.wait(timeout=5)

        return Stream

    @contextmanager
    def context(self, stream: object) -> Iterator[None]:
        self.current.stream = stream
        try:
            yield
        finally:
            self.current.stream = None

    def fence(self, stream: object) -> Any:
        streams = self

        class Fence:
            def wait(self) -> None:
                streams.fenced_on[threading.get_ident()] = stream

        return Fence()


async def test_concurrent_copies_share_one_private_stream_and_wait_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    streams = _Streams(threading.get_ident())
    monkeypatch.setattr(torch.cuda, "Stream", streams.stream_class())
    monkeypatch.setattr(torch.cuda, "stream", streams.context)
    monkeypatch.setattr(copy_out, "CudaFence", streams.fence)

    def copy(blocks: object, count: int, out: object, *, out_start: int) -> None:
        streams.copied_on[threading.get_ident()] = streams.current.stream

    pool = SimpleNamespace(device=torch.device("cuda", 0), block_size=16, copy_out=copy,
                           layout=SimpleNamespace(bytes_per_token=4))
    copier = RoundCopier(pool, threads=2)  # type: ignore[arg-type]
    caller = object()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for start in (0, 16):
                tg.start_soon(functools.partial(copier.copy, [start // 16], {}, start, 16, after=caller))
    assert len(streams.copied_on) == 2
    for thread, stream in streams.copied_on.items():
        assert streams.waited_after[thread] is stream, "the copy ran on a stream that did not wait for the caller's"
        assert streams.fenced_on[thread] is stream, "the copy ran on one stream and waited for another"
    assert len(streams.made) == 1, f"{len(streams.made)} private streams made, one expected"
