"""A real network partition over Mooncake TCP (the shared suite; root only): see
:mod:`aioembed.testing.partition`. With the receiver's fences made to trust silence (a mutation: grants fenced
for a silent, dropped or failed writer freed at once), 3 of 5 runs had a Y room fail its check with "data
differ from the source" (X's late bytes in a block handed to Y) and the other 2 failed on the fence count."""

from __future__ import annotations

from typing import Any

from aioembed.testing.partition import PartitionSuite


class TestPartition(PartitionSuite):
    transport_name = "mooncake"

    def transport_options(self, ip: str) -> dict[str, Any]:
        return {"protocol": "tcp", "hostname": ip, "transfer_timeout": 5}
