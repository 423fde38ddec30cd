"""A real network partition over UCX TCP (the shared suite; root only): see :mod:`aioembed.testing.partition`.

UCX's receives are posted by the owner: with the receiver's fences made to trust silence (the mutation of the
Mooncake and NIXL runs), 2 of 2 runs here still passed, because the writes cut were being received, and the
owner's stall timer (``write_timeout``, 5 s here) aborted the connection before the heal, so X's late bytes met
a closed socket. That is not a bound: an idle connection has no stall timer, and an eager write whose header was
still queued at X arrives with its payloads after the heal, into receives the owner posts then
(``UcxTransport.orphan_lifetime``). The scenario checks liveness, clear errors and Y's rows."""

from __future__ import annotations

from typing import Any

from aioembed.testing.partition import PartitionSuite

from .conftest import UCX_OPTIONS


class TestPartition(PartitionSuite):
    transport_name = "ucx"
    fenced_when_y_is_done = False  # X proves its writes over (DRAINED) a write lifetime after they failed

    def transport_options(self, ip: str) -> dict[str, Any]:
        # The kernel's default horizon: this network can hold a closed socket's bytes (not the one-host tests').
        return {**{k: v for k, v in UCX_OPTIONS.items() if k != "tcp_orphan_seconds"}, "host": ip}
