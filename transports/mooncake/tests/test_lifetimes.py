"""How long the plugin says a failed write, or a gone writer's, may still land over TCP."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from aioembed.errors import ConfigError
from aioembed.transports.tcp_orphans import orphan_retransmit_horizon

from aioembed_mooncake.transport import MooncakeTransport, _Config


def test_over_tcp_both_lifetimes_cover_what_a_closed_socket_still_retransmits() -> None:
    """A lane that failed, or a process that ended, closed its sockets gracefully: the kernel retransmits what they
    had queued for about 102 s (Linux's defaults), and a partition healing meanwhile delivers it into the receiver's
    blocks. Both lifetimes were shorter (32 s, 2 s)."""
    engine = SimpleNamespace(transfer_check_status=lambda batch: 0)  # the poller's one engine call; none is made
    t = MooncakeTransport(_Config({"protocol": "tcp", "hostname": "127.0.0.1"}), engine, "127.0.0.1:1", 1)
    horizon = orphan_retransmit_horizon()
    assert t.write_lifetime >= horizon + 2.0 and t.write_lifetime >= t.progress_timeout + 2.0
    assert t.orphan_lifetime >= horizon + 2.0
    assert MooncakeTransport.capabilities.orphan_lifetime == 2.0  # RDMA: the process's queue pairs die with it


def test_tcp_orphan_seconds_sets_the_floor_and_is_checked() -> None:
    engine = SimpleNamespace(transfer_check_status=lambda batch: 0)
    opts = {"protocol": "tcp", "hostname": "127.0.0.1", "tcp_orphan_seconds": 1.0}
    t = MooncakeTransport(_Config(opts), engine, "127.0.0.1:1", 1)
    assert t.orphan_lifetime == 3.0 and t.write_lifetime == t.progress_timeout + 2.0
    for bad in (-1, float("nan"), True, "10"):
        with pytest.raises(ConfigError, match="tcp_orphan_seconds"):
            _Config(dict(opts, tcp_orphan_seconds=bad))
