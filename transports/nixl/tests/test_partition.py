"""A real network partition over NIXL's UCX backend on TCP (the shared suite; root only): see
:mod:`aioembed.testing.partition`. NIXL's writes are one-sided: with the receiver's fences made to trust
silence (a mutation: grants fenced for a silent, dropped or failed writer freed at once), 1 of 2 runs had a
Y room fail its check with "data differ from the source" (X's late bytes in a block handed to Y)."""

from __future__ import annotations

from typing import Any

from aioembed.testing.partition import PartitionSuite

from .conftest import NIXL_TCP_OPTIONS


class TestPartition(PartitionSuite):
    transport_name = "nixl"
    # X's writes can complete after the heal, within write_timeout, and X then proves them over (DRAINED) at once:
    # its blocks need not be fenced when Y is done (1 of 2 runs had none, with the 104 s lifetimes over TCP).
    fenced_when_y_is_done = False

    def transport_options(self, ip: str) -> dict[str, Any]:
        # NIXL's UCX uses the namespace's one link (and its loopback). The kernel's default horizon: this network
        # can hold a closed socket's bytes (not the one-host tests' tcp_orphan_seconds).
        return {k: v for k, v in NIXL_TCP_OPTIONS.items() if k != "tcp_orphan_seconds"}
