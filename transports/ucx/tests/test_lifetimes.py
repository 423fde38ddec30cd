"""How long the plugin says a failed write, or a gone writer's, may still land: over TCP, what a closed socket's
kernel still retransmits."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from aioembed.errors import ConfigError
from aioembed.transports.tcp_orphans import orphan_retransmit_horizon, ucx_tls_may_use_tcp

from aioembed_ucx._options import UcxOptions
from aioembed_ucx.transport import UcxTransport


def endpoint(options: dict[str, Any], context_tls: str) -> UcxTransport:
    """An endpoint on a fake ucxx whose live context was made with ``context_tls`` (no UCX call is made)."""
    ucxx = SimpleNamespace(get_config=lambda: {"TLS": context_tls},
                           core=SimpleNamespace(_get_ctx=lambda: SimpleNamespace(progress_mode="blocking")),
                           exceptions=SimpleNamespace(UCXError=RuntimeError))

    async def make() -> UcxTransport:
        return UcxTransport(UcxOptions.parse(options), ucxx, "127.0.0.1")

    return asyncio.run(make())


@pytest.mark.parametrize("tls", ["tcp", "all", "rc,tcp", "^ud"])
def test_over_tcp_both_lifetimes_cover_what_a_closed_socket_still_retransmits(tls: str) -> None:
    """A writer's process that ended, or a failed write whose endpoint the writer aborted: the socket is closed
    gracefully and its kernel retransmits what was queued for about 102 s (Linux's defaults). The owner's posted
    receives are not cancelled before that (an idle connection has no stall timer, and an eager write's header
    arrives with its payloads), so a partition healing meanwhile lands the bytes. Both lifetimes were 2 s."""
    t = endpoint({}, tls)
    horizon = orphan_retransmit_horizon()
    assert t.orphan_lifetime == horizon + 2.0 and t.write_lifetime == horizon + 2.0
    assert UcxTransport.capabilities.orphan_lifetime == 2.0 == UcxTransport.capabilities.write_lifetime


@pytest.mark.parametrize("tls", ["rc,cuda_copy", "sm,self", "^tcp", "cma,sockcm"])
def test_without_tcp_the_lifetimes_stay_two_seconds(tls: str) -> None:
    t = endpoint({}, tls)
    assert t.orphan_lifetime == 2.0 and t.write_lifetime == 2.0


def test_which_tls_settings_may_use_tcp() -> None:
    for tls, tcp in [(None, True), ("", True), ("all", True), ("TCP", True), ("^rc", True), ("^tcp,rc", False),
                     ("tcp:aux,rc", True), ("rc,ud", False), ("sockcm,rc", False)]:
        assert ucx_tls_may_use_tcp(tls) is tcp, tls


def test_tcp_orphan_seconds_sets_the_floor_and_is_checked() -> None:
    t = endpoint({"tcp_orphan_seconds": 1.0}, "tcp")
    assert t.orphan_lifetime == 3.0 and t.write_lifetime == 3.0
    assert endpoint({"tcp_orphan_seconds": 0}, "tcp").orphan_lifetime == 2.0  # never below the 2 s of a live owner
    assert endpoint({"tcp_orphan_seconds": 500}, "rc").orphan_lifetime == 2.0  # no TCP: not used
    for bad in (-1, float("nan"), True, "10", 86401):
        with pytest.raises(ConfigError, match="tcp_orphan_seconds"):
            UcxOptions.parse({"tcp_orphan_seconds": bad})
