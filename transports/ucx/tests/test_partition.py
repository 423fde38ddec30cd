"""A real network partition over UCX TCP (the shared suite; root only): see :mod:`aioembed.testing.partition`.

UCX's receives are posted by the owner, so late bytes of a cut writer find no receive into a block handed
to another room: with the receiver's fences made to trust silence (the mutation of the Mooncake and NIXL
runs), 2 of 2 runs here still passed. The scenario still checks liveness, clear errors and Y's rows."""

from __future__ import annotations

from typing import Any

from aioembed.testing.partition import PartitionSuite

from .conftest import UCX_OPTIONS


class TestPartition(PartitionSuite):
    transport_name = "ucx"
    fenced_when_y_is_done = False  # X proves its writes over (DRAINED) a write lifetime after they failed

    def transport_options(self, ip: str) -> dict[str, Any]:
        return dict(UCX_OPTIONS, host=ip)
