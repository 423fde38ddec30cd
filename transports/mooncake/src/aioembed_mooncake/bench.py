"""Raw baseline of ``aioembed bench --transport mooncake``: the ``TransferEngine`` with no aioembed.

Registered in the entry-point group ``aioembed.bench_baselines`` as ``mooncake``. Two engines,
each started exactly as the transport starts its own (:func:`aioembed_mooncake._engine.start_engine`
with the same parsed ``transport_options``): one in the benchmark process, which registers the
source tensors once, and one in a peer process (``python -m aioembed_mooncake.bench SPEC``),
which allocates and registers one zero-filled destination tensor per layout field of
``capacity_tokens`` rows. A transfer of ``n`` tokens is one ``batch_transfer_sync_write`` with
one op per field (rows ``[0, n)`` to rows ``[0, n)``), the ops aioembed's planner makes for a
contiguous reservation. Methods:

* ``batch_write``: that one call, made on the calling (event-loop) thread; nothing else runs
  during a raw measurement, and the engine releases the GIL while it works;
* ``batch_write_split``: the same ops cut and batched as the transport cuts them
  (``max_batch_bytes`` / ``max_batch_ops``), the batches run concurrently in
  ``max(1, threads // 2)`` worker threads, as one aioembed write runs them.

The fastest median counts as "raw". After setup one write of up to 64 tokens is checked bit
for bit in the peer (SHA-256 per field), so the baseline cannot time writes that land nowhere.

Each CPU destination tensor is on huge pages, as the receive pool's fields are
(:func:`aioembed.bench.baselines.destination_memory`), so that the raw side never writes into slower
memory than aioembed does.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import torch
from aioembed.bench.baselines import BaselinePeer, destination_memory
from aioembed.bench.event_channel import claim_stdout, emit
from aioembed.config import TransferConfig
from aioembed.errors import TransportError
from aioembed.layout import Layout

from aioembed_mooncake._engine import destroy_engine, start_engine
from aioembed_mooncake.transport import _Config

__all__ = ["MooncakeBaseline", "main"]

_CHECK_TOKENS = 64


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class MooncakeBaseline:
    """Direct ``TransferEngine`` batch writes into a peer process (see the module doc)."""

    description = (
        "Mooncake TransferEngine without aioembed: the registered source tensors written with "
        "batch_transfer_sync_write, one op per field, into registered destination tensors of a second engine in "
        "a peer process (same transport_options); batch_write = one call on the calling thread, "
        "batch_write_split = the transport's batching (max_batch_bytes/max_batch_ops, threads//2 worker threads)"
    )
    methods: tuple[str, ...] = ("batch_write", "batch_write_split")
    cross_process = True

    def __init__(self, layout: Layout, config: TransferConfig) -> None:
        self.layout = layout
        self.config = config
        self.options = dict(config.transport_options)
        self._cfg = _Config(self.options, announce=False)  # the aioembed endpoint opened beside it says the choices
        self._engine: Any = None
        self._rpc_port = 0
        self._session = ""
        self._src: dict[str, torch.Tensor] = {}
        self._dst: dict[str, int] = {}
        self._registered: list[int] = []
        self._peer = BaselinePeer("mooncake")

    # -- RawBaseline ---------------------------------------------------------------------

    async def setup(self, sources: Mapping[str, torch.Tensor], capacity_tokens: int) -> None:
        spec = {"options": self.options, "capacity": capacity_tokens,
                "fields": [[name, f.row_bytes] for name, f in self.layout.items()]}
        ready = await self._peer.start("aioembed_mooncake.bench", spec)
        self._session, self._dst = str(ready["session"]), {k: int(v) for k, v in ready["addrs"].items()}
        started = await anyio.to_thread.run_sync(start_engine, self._cfg.engine_settings())
        self._engine, self._rpc_port = started.engine, started.rpc_port
        self._src = {name: sources[name].contiguous() for name in self.layout}
        addrs = [t.data_ptr() for t in self._src.values()]
        lens = [t.numel() * t.element_size() for t in self._src.values()]
        rc = self._engine.batch_register_memory(addrs, lens)
        if rc != 0:
            raise TransportError(f"mooncake baseline: batch_register_memory of the sources returned {rc}")
        self._registered = addrs
        n = min(_CHECK_TOKENS, capacity_tokens)
        await self.transfer("batch_write", n)
        got = await self._peer.ask({"op": "sum", "tokens": n})
        want = {name: _digest(t[:n]) for name, t in self._src.items()}
        if got.get("sums") != want:
            raise TransportError("mooncake baseline: the check write did not land bit for bit in the peer")

    def _ops(self, num_tokens: int) -> tuple[list[int], list[int], list[int]]:
        srcs, dsts, lens = [], [], []
        for name, f in self.layout.items():
            srcs.append(self._src[name].data_ptr())
            dsts.append(self._dst[name])
            lens.append(num_tokens * f.row_bytes)
        return srcs, dsts, lens

    async def transfer(self, method: str, num_tokens: int) -> None:
        srcs, dsts, lens = self._ops(num_tokens)
        if method == "batch_write":
            rc = self._engine.batch_transfer_sync_write(self._session, srcs, dsts, lens)
            if rc != 0:
                raise TransportError(f"mooncake baseline: batch_transfer_sync_write returned {rc}")
            await anyio.lowlevel.checkpoint()
        elif method == "batch_write_split":
            await self._split(srcs, dsts, lens)
        else:
            raise ValueError(f"unknown mooncake baseline method {method!r}; known: {self.methods}")

    async def _split(self, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        step, max_ops = self._cfg.max_batch_bytes, self._cfg.max_batch_ops
        pieces = [(s + a, d + a, min(step, n - a)) for s, d, n in zip(srcs, dsts, lens, strict=True)
                  for a in range(0, n, step)]
        batches: list[list[tuple[int, int, int]]] = []
        cur: list[tuple[int, int, int]] = []
        cur_bytes = 0
        for p in pieces:
            if cur and (cur_bytes + p[2] > step or len(cur) >= max_ops):
                batches.append(cur)
                cur, cur_bytes = [], 0
            cur.append(p)
            cur_bytes += p[2]
        if cur:
            batches.append(cur)
        limiter = anyio.CapacityLimiter(max(1, self._cfg.threads // 2))
        write = self._engine.batch_transfer_sync_write
        failed: list[int] = []

        async def run(batch: list[tuple[int, int, int]]) -> None:
            rc = await anyio.to_thread.run_sync(write, self._session, [b[0] for b in batch], [b[1] for b in batch],
                                                [b[2] for b in batch], limiter=limiter)
            if rc != 0:
                failed.append(int(rc))

        async with anyio.create_task_group() as tg:
            for batch in batches:
                tg.start_soon(run, batch)
        if failed:
            raise TransportError(f"mooncake baseline: batch_transfer_sync_write returned {failed}")

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._peer.aclose()
            if self._engine is not None:
                if self._registered:
                    self._engine.batch_unregister_memory(self._registered)
                    self._registered = []
                box = [self._engine]
                self._engine = None
                await anyio.to_thread.run_sync(destroy_engine, box, self._rpc_port)
            self._src, self._dst = {}, {}


# -- the peer process --------------------------------------------------------------------


def _peer(spec: dict[str, Any]) -> None:
    cfg = _Config(spec["options"], announce=False)  # the parent's endpoint said the choices
    started = start_engine(cfg.engine_settings())
    engine = started.engine
    capacity = int(spec["capacity"])
    dst = {str(name): destination_memory(capacity * int(row)) for name, row in spec["fields"]}
    rows = {str(name): int(row) for name, row in spec["fields"]}
    addrs = [t.data_ptr() for t in dst.values()]
    rc = engine.batch_register_memory(addrs, [t.numel() for t in dst.values()])
    if rc != 0:
        raise SystemExit(f"batch_register_memory returned {rc}")
    emit(session=started.session, addrs={k: t.data_ptr() for k, t in dst.items()}, pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "sum":
            n = int(cmd["tokens"])
            emit(sums={k: _digest(t[: n * rows[k]]) for k, t in dst.items()})
        elif cmd.get("op") == "exit":
            emit(bye=True)
            break
    engine.batch_unregister_memory(addrs)
    box, port = [engine], started.rpc_port
    del engine, started
    destroy_engine(box, port)


def main(argv: list[str] | None = None) -> None:
    """Peer process entry point: ``python -m aioembed_mooncake.bench SPEC_JSON``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m aioembed_mooncake.bench SPEC_JSON")
    _peer(json.loads(args[0]))


if __name__ == "__main__":
    claim_stdout()  # native libraries print to fd 1: keep it for the JSON lines only
    main()
