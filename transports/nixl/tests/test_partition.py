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
    fenced_when_y_is_done = False  # X proves its writes over (DRAINED) a write lifetime after they failed

    def transport_options(self, ip: str) -> dict[str, Any]:
        return dict(NIXL_TCP_OPTIONS)  # NIXL's UCX uses the namespace's one link (and its loopback)
