"""The descriptor a NIXL endpoint announces: plain msgpack, never pickle.

NIXL's Python API serialises descriptor lists with ``pickle`` (``get_serialized_descs``), and
unpickling a peer's bytes runs the peer's code. The plugin sends only data: the agent's name, its
backend, the announced regions as ``[address, length, device]`` and NIXL's agent metadata blob
(``get_agent_metadata()``: NIXL's own binary serialisation, parsed by ``add_remote_agent`` in C++,
which refuses what it cannot parse). Every field is checked here before any of it reaches NIXL.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
from aioembed.errors import TransportError
from aioembed.transports.base import MemoryRegion

__all__ = ["DESCRIPTOR_VERSION", "MAX_METADATA", "PeerDescriptor", "check_device", "decode", "encode"]

DESCRIPTOR_VERSION = 1
MAX_METADATA = 64 << 20
_AGENT = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")


def check_device(region: MemoryRegion) -> None:
    """Only host memory (``cpu``) and CUDA memory (``cuda:N``) have a NIXL memory type here."""
    d = region.device
    if d == "cpu" or (d.startswith("cuda:") and d[5:].isdigit()):
        return
    raise TransportError(f"nixl transport registers 'cpu' or 'cuda:N' memory, got device {d!r} in {region}")


@dataclass(frozen=True)
class PeerDescriptor:
    """A parsed descriptor."""

    agent: str
    backend: str
    metadata: bytes
    regions: tuple[MemoryRegion, ...]


def encode(agent: str, backend: str, metadata: bytes, regions: Sequence[MemoryRegion]) -> bytes:
    return msgpack.packb({
        "transport": "nixl",
        "v": DESCRIPTOR_VERSION,
        "agent": agent,
        "backend": backend,
        "md": metadata,
        "regions": [[r.address, r.length, r.device] for r in regions],
    })


def decode(blob: bytes) -> PeerDescriptor:
    """Parse and check a peer's descriptor; ``TransportError`` for anything that is not one."""
    try:
        d = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_bin_len=MAX_METADATA)
        if not isinstance(d, dict) or d.get("transport") != "nixl":
            raise ValueError("not a nixl descriptor")
        if d.get("v") != DESCRIPTOR_VERSION:
            raise ValueError(f"descriptor version {d.get('v')!r}, this plugin reads {DESCRIPTOR_VERSION}")
        agent, backend, md = d.get("agent"), d.get("backend"), d.get("md")
        if not isinstance(agent, str) or not _AGENT.match(agent):
            raise ValueError(f"bad agent name {agent!r}")
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"bad backend {backend!r}")
        if not isinstance(md, bytes) or not md:
            raise ValueError("no agent metadata")
        raw = d.get("regions")
        if not isinstance(raw, list):
            raise ValueError("no region list")
        regions = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                       for x in item[:2])
                    and isinstance(item[2], str)):
                raise ValueError(f"bad region {item!r}")
            r = MemoryRegion(item[0], item[1], item[2])
            check_device(r)
            regions.append(r)
        return PeerDescriptor(agent, backend, md, tuple(regions))
    except Exception as exc:
        raise TransportError(f"bad nixl descriptor ({len(blob)} bytes): {exc}") from exc
