"""Raw baseline of ``aioembed bench --transport ucx``: a ucxx endpoint pair with no aioembed.

Registered in the entry-point group ``aioembed.bench_baselines`` as ``ucx``. A peer process
(``python -m aioembed_ucx.bench SPEC``) initialises UCX with the same parsed
``transport_options`` as the transport (:func:`aioembed_ucx._context.ensure_context`: ``tls``,
``progress_mode``, ``ucx_options``), allocates one zero-filled destination tensor per layout
field of ``capacity_tokens`` rows and listens; the benchmark process connects one endpoint to it
(``ucxx.create_endpoint``). Method ``send_recv``: for a transfer of ``n`` tokens the benchmark
process sends rows ``[0, n)`` of every field as one tag message per field (``ep.send``, the three
concurrently, straight from the source tensors), which the peer receives with ``ep.recv`` into
receives it posted in advance over each whole destination tensor (no header, no staging copy),
then it sends a 16-byte acknowledgement that the benchmark process awaits: the bytes are then
visible at the destination. That is the least a two-sided transfer needs; aioembed's write adds a
header and a "go" reply before the data (see the transport's docs).

After setup one transfer of up to 64 tokens is checked bit for bit in the peer (SHA-256 per
field), so the baseline cannot time messages that land nowhere.

Each CPU destination tensor is on huge pages, as the receive pool's fields are
(:func:`aioembed.bench.baselines.destination_memory`), so that the raw side never writes into slower
memory than aioembed does.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
from aioembed.bench.baselines import BaselinePeer, destination_memory
from aioembed.bench.event_channel import claim_stdout, emit
from aioembed.config import TransferConfig
from aioembed.errors import TransportError
from aioembed.layout import Layout

from aioembed_ucx._context import ensure_context
from aioembed_ucx._options import UcxOptions
from aioembed_ucx._progress import tag_recv, tag_send

__all__ = ["UcxBaseline", "main"]

_CHECK_TOKENS = 64
_ACK_TAG = 1 << 20
_ACK = b"aioembed-ack\0\0\0\0"


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _span(address: int, length: int) -> Any:
    """A zero-copy writable buffer over host memory, as the transport hands ucxx."""
    return (ctypes.c_char * length).from_address(address)


class UcxBaseline:
    """Direct ucxx ``send``/``recv`` into a peer process's preallocated buffers (see the module doc)."""

    description = (
        "ucxx without aioembed: one endpoint to a peer process (same tls/progress_mode/ucx_options); per transfer "
        "one ep.send per field (concurrently) from the source tensors into ep.recv's pre-posted over the peer's "
        "preallocated destination tensors, then a 16-byte acknowledgement from the peer; in blocking mode every "
        "request is awaited through the plugin's event-driven progress, as aioembed's are (ucxx's own wait polls on "
        "every loop turn and kept a core busy in each process, the idle peer's too, while the other variants ran)"
    )
    methods: tuple[str, ...] = ("send_recv",)
    cross_process = True

    def __init__(self, layout: Layout, config: TransferConfig) -> None:
        self.layout = layout
        self.options = dict(config.transport_options)
        self._opts = UcxOptions.parse(self.options)
        self._peer = BaselinePeer("ucx")
        self._ep: Any = None
        self._src: dict[str, torch.Tensor] = {}

    async def setup(self, sources: Mapping[str, torch.Tensor], capacity_tokens: int) -> None:
        spec = {"options": self.options, "capacity": capacity_tokens,
                "fields": [[name, f.row_bytes] for name, f in self.layout.items()]}
        ready = await self._peer.start("aioembed_ucx.bench", spec)
        ucxx = ensure_context(self._opts)
        self._ep = await asyncio.wait_for(ucxx.create_endpoint(str(ready["host"]), int(ready["port"])),
                                          self._opts.connect_timeout)
        self._src = {name: sources[name].contiguous() for name in self.layout}
        n = min(_CHECK_TOKENS, capacity_tokens)
        await self.transfer("send_recv", n)
        got = await self._peer.ask({"op": "sum", "tokens": n})
        want = {name: _digest(t[:n]) for name, t in self._src.items()}
        if got.get("sums") != want:
            raise TransportError("ucx baseline: the check transfer did not land bit for bit in the peer")

    async def transfer(self, method: str, num_tokens: int) -> None:
        if method != "send_recv":
            raise ValueError(f"unknown ucx baseline method {method!r}; known: {self.methods}")
        ep = self._ep
        ack = bytearray(len(_ACK))
        ack_recv = asyncio.ensure_future(tag_recv(ep, ack, _ACK_TAG))
        try:
            await asyncio.gather(*(
                tag_send(ep, _span(self._src[name].data_ptr(), num_tokens * f.row_bytes), i)
                for i, (name, f) in enumerate(self.layout.items())
            ))
            await asyncio.wait_for(ack_recv, self._opts.write_timeout)
        finally:
            ack_recv.cancel()
        if bytes(ack) != _ACK:
            raise TransportError(f"ucx baseline: bad acknowledgement {bytes(ack)!r}")

    async def aclose(self) -> None:
        await self._peer.aclose()
        if self._ep is not None:
            ep, self._ep = self._ep, None
            with contextlib.suppress(Exception):  # best effort at teardown
                ep.abort()
            await asyncio.sleep(0)
        self._src = {}


# -- the peer process --------------------------------------------------------------------


async def _peer(spec: dict[str, Any]) -> None:
    opts = UcxOptions.parse(spec["options"])
    ucxx = ensure_context(opts)
    capacity = int(spec["capacity"])
    rows = {str(name): int(row) for name, row in spec["fields"]}
    dst = {name: destination_memory(capacity * row) for name, row in rows.items()}
    errors: list[BaseException] = []

    async def serve(ep: Any) -> None:
        def post() -> list[asyncio.Future[Any]]:
            return [asyncio.ensure_future(tag_recv(ep, _span(t.data_ptr(), t.numel()), i))
                    for i, t in enumerate(dst.values())]

        pending = post()
        try:
            while True:
                await asyncio.gather(*pending)
                pending = post()  # the next transfer's receives are posted before this one is acknowledged
                await tag_send(ep, _ACK, _ACK_TAG)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # the benchmark process closing its endpoint ends the loop
            errors.append(exc)
        finally:
            for f in pending:
                f.cancel()

    listener = ucxx.create_listener(serve, port=0)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    emit(host=opts.host, port=int(listener.port), pid=os.getpid())
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd.get("op") == "sum":
            n = int(cmd["tokens"])
            emit(sums={k: _digest(t[: n * rows[k]]) for k, t in dst.items()})
        elif cmd.get("op") == "exit":
            emit(bye=True)
            break
    await asyncio.sleep(0)
    listener.close()


def main(argv: list[str] | None = None) -> None:
    """Peer process entry point: ``python -m aioembed_ucx.bench SPEC_JSON``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m aioembed_ucx.bench SPEC_JSON")
    asyncio.run(_peer(json.loads(args[0])))


if __name__ == "__main__":
    claim_stdout()  # native libraries print to fd 1: keep it for the JSON lines only
    main()
