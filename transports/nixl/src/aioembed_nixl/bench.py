"""Raw baseline of ``aioembed bench --transport nixl``: two NIXL agents with no aioembed on the path.

Registered in the entry-point group ``aioembed.bench_baselines`` as ``nixl``. A peer process
(``python -m aioembed_nixl.bench SPEC``) creates a NIXL agent exactly as the transport does
(:func:`aioembed_nixl._native.create_agent`, same ``transport_options``: backend, ``ucx_tls``,
``ucx_options``, ``progress_delay``), registers one zero-filled destination tensor per layout field of
``capacity_tokens`` rows and prints its agent metadata; with CUDA sources the destination is on their
device and both sides register ``VRAM`` (GPU to GPU, as the transport moves a GPU pool's rows). The
benchmark process creates its own agent, registers the source tensors and loads that metadata. Per
transfer of ``n`` tokens it writes rows ``[0, n)`` of every field as **one** NIXL transfer and waits in
a tight ``check_xfer_state`` loop on the calling thread (NIXL's examples do the same; nothing else runs
during a raw measurement). Methods:

* ``prepped``: local and remote lists of one descriptor per row, prepared once at setup (what a
  NIXL user with a row or block pool does); a transfer is ``make_prepped_xfer`` with the row indices;
* ``initialize_xfer``: one descriptor per field on each side, built for the transfer and passed to
  ``initialize_xfer`` (NIXL's combined call).

The faster median counts as raw. After setup one transfer of up to 64 tokens is checked bit for bit
in the peer (SHA-256 per field), so the baseline cannot time transfers that land nowhere.

Each CPU destination tensor is on huge pages, as the receive pool's fields are
(:func:`aioembed.bench.baselines.destination_memory`), so that the raw side never writes into slower
memory than aioembed does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from aioembed.bench.baselines import BaselinePeer, destination_memory
from aioembed.bench.event_channel import claim_stdout, emit
from aioembed.config import TransferConfig
from aioembed.errors import TransportError
from aioembed.layout import Layout

from aioembed_nixl._dlists import device_id, mem_type
from aioembed_nixl._native import create_agent, load_nixl
from aioembed_nixl._options import NixlOptions

__all__ = ["NixlBaseline", "main"]

_CHECK_TOKENS = 64


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _rows(base: int, rows: int, row_bytes: int, dev: int = 0) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """``rows x 3`` descriptors (address, length, device id): one per row."""
    arr = np.empty((rows, 3), dtype=np.uint64)
    arr[:, 0] = np.uint64(base) + np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes)
    arr[:, 1] = row_bytes
    arr[:, 2] = dev
    return arr


def _settle(device: torch.device) -> None:
    """Wait until the work queued on ``device``'s current stream (the copies or fills that made a baseline's
    tensors) has completed: NIXL moves GPU memory outside torch's stream order."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _wait(agent: Any, xfer: Any, timeout: float) -> None:
    state = agent.transfer(xfer)
    deadline = time.monotonic() + timeout
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TransportError(f"nixl baseline: a transfer did not complete within {timeout} s")
        state = agent.check_xfer_state(xfer)
    if state != "DONE":
        raise TransportError(f"nixl baseline: transfer ended in state {state!r}")


class NixlBaseline:
    """Direct NIXL writes into a peer process's preallocated tensors (see the module doc)."""

    description = (
        "NIXL without aioembed: an agent per process (same backend/ucx_tls/progress_delay), per transfer one WRITE "
        "of every field's rows, prepared row lists (make_prepped_xfer) or initialize_xfer, waited in a tight "
        "check_xfer_state loop on the calling thread"
    )
    methods: tuple[str, ...] = ("prepped", "initialize_xfer")
    cross_process = True
    cuda = True

    def __init__(self, layout: Layout, config: TransferConfig) -> None:
        self.layout = layout
        self.options = dict(config.transport_options)
        self._opts = NixlOptions.parse(self.options)
        self._peer_process = BaselinePeer("nixl")
        self._agent: Any = None
        self._peer = ""
        self._src: dict[str, torch.Tensor] = {}
        self._dst: dict[str, int] = {}
        self._local: Any = None
        self._remote: Any = None
        self._bases: dict[str, int] = {}
        self._mem, self._dev = "DRAM", 0

    async def setup(self, sources: Mapping[str, torch.Tensor], capacity_tokens: int) -> None:
        self._src = {name: sources[name].contiguous() for name in self.layout}
        device = next(iter(self._src.values())).device
        self._mem, self._dev = mem_type(str(device)), device_id(str(device))
        _settle(device)  # NIXL reads the sources with no regard for torch's streams
        spec = {"options": self.options, "capacity": capacity_tokens, "device": str(device),
                "fields": [[name, f.row_bytes] for name, f in self.layout.items()]}
        ready = await self._peer_process.start("aioembed_nixl.bench", spec)
        self._dst = {str(k): int(v) for k, v in ready["addresses"].items()}
        await asyncio.to_thread(self._prepare, bytes.fromhex(ready["metadata"]), capacity_tokens)
        n = min(_CHECK_TOKENS, capacity_tokens)
        await self.transfer("prepped", n)
        got = await self._peer_process.ask({"op": "sum", "tokens": n})
        want = {name: _digest(t[:n]) for name, t in self._src.items()}
        if got.get("sums") != want:
            raise TransportError("nixl baseline: the check transfer did not land bit for bit in the peer")

    def _prepare(self, metadata: bytes, capacity: int) -> None:
        nixl = load_nixl()
        self._agent = agent = create_agent(nixl, f"aioembed-bench-{uuid.uuid4().hex[:12]}", self._opts)
        mem, dev = self._mem, self._dev
        for t in self._src.values():
            agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), dev, "")], mem)
        loaded = agent.add_remote_agent(metadata)
        self._peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        agent.make_connection(self._peer)
        local, remote = [], []
        for i, (name, f) in enumerate(self.layout.items()):
            local.append(_rows(self._src[name].data_ptr(), capacity, f.row_bytes, dev))
            remote.append(_rows(self._dst[name], capacity, f.row_bytes, dev))
            self._bases[name] = i * capacity  # field i's rows start here in both lists
        self._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.concatenate(local), mem)
        self._remote = agent.prep_xfer_dlist(self._peer, np.concatenate(remote), mem)

    def _transfer(self, method: str, num_tokens: int) -> None:
        agent = self._agent
        timeout = self._opts.write_timeout
        if method == "prepped":
            rows = np.arange(num_tokens, dtype=np.int32)
            indices = np.concatenate([rows + self._bases[n] for n in self.layout])
            xfer = agent.make_prepped_xfer("WRITE", self._local, indices, self._remote, indices)
        elif method == "initialize_xfer":
            spans = [(self._src[n].data_ptr(), self._dst[n], num_tokens * f.row_bytes) for n, f in self.layout.items()]
            mem, dev = self._mem, self._dev
            ld = agent.get_xfer_descs([(s, k, dev) for s, _, k in spans], mem)
            rd = agent.get_xfer_descs([(d, k, dev) for _, d, k in spans], mem)
            xfer = agent.initialize_xfer("WRITE", ld, rd, self._peer)
        else:
            raise ValueError(f"unknown nixl baseline method {method!r}; known: {self.methods}")
        try:
            _wait(agent, xfer, timeout)
        finally:
            xfer.release()

    async def transfer(self, method: str, num_tokens: int) -> None:
        self._transfer(method, num_tokens)  # blocking on purpose: nothing else runs during a raw measurement
        await asyncio.sleep(0)

    async def aclose(self) -> None:
        await self._peer_process.aclose()
        if self._agent is not None:
            for handle in (self._local, self._remote):
                if handle is not None:
                    handle.release()
            self._local = self._remote = None
            agent, self._agent = self._agent, None
            await asyncio.to_thread(_drop, agent)
        self._src = {}


def _drop(agent: Any) -> None:
    """Destroy the agent off the loop (its destructor joins NIXL's progress thread)."""
    del agent


# -- the peer process --------------------------------------------------------------------


def _peer(spec: dict[str, Any]) -> None:
    opts = NixlOptions.parse(spec["options"])
    agent = create_agent(load_nixl(), f"aioembed-bench-peer-{uuid.uuid4().hex[:12]}", opts)
    capacity = int(spec["capacity"])
    rows = {str(name): int(row) for name, row in spec["fields"]}
    device = torch.device(spec.get("device", "cpu"))
    mem, dev = mem_type(str(device)), device_id(str(device))
    dst = {name: (destination_memory(capacity * row) if device.type == "cpu"
                  else torch.zeros(capacity * row, dtype=torch.uint8, device=device)) for name, row in rows.items()}
    _settle(device)  # the zero fill lands before any write, not after it
    for t in dst.values():
        agent.register_memory([(t.data_ptr(), t.numel(), dev, "")], mem)

    emit(metadata=bytes(agent.get_agent_metadata()).hex(), addresses={k: t.data_ptr() for k, t in dst.items()},
         pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "sum":
            n = int(cmd["tokens"])
            emit(sums={k: _digest(t[: n * rows[k]]) for k, t in dst.items()})
        elif cmd.get("op") == "exit":
            emit(bye=True)
            break


def main(argv: list[str] | None = None) -> None:
    """Peer process entry point: ``python -m aioembed_nixl.bench SPEC_JSON``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m aioembed_nixl.bench SPEC_JSON")
    _peer(json.loads(args[0]))


if __name__ == "__main__":
    claim_stdout()  # native libraries print to fd 1: keep it for the JSON lines only
    main()
