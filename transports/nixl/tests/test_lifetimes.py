"""How long the plugin says a failed write, or a gone writer's, may still land: over TCP, what a closed socket's
kernel still retransmits."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from aioembed.errors import ConfigError
from aioembed.transports.tcp_orphans import orphan_retransmit_horizon

from aioembed_nixl._options import NixlOptions
from aioembed_nixl.transport import NixlTransport


def endpoint(options: dict[str, Any], environ: dict[str, str] | None = None,
             monkeypatch: pytest.MonkeyPatch | None = None) -> NixlTransport:
    """An endpoint on a fake agent (no NIXL call is made): only its lifetimes are looked at."""
    if monkeypatch is not None:
        monkeypatch.delenv("UCX_TLS", raising=False)
        for k, v in (environ or {}).items():
            monkeypatch.setenv(k, v)
    worker = SimpleNamespace(stop_after=lambda *args: None)
    engine = SimpleNamespace(name="aioembed-test", teardown=lambda w: None)
    return NixlTransport(NixlOptions.parse(options), SimpleNamespace(), worker, engine)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [{"ucx_tls": "tcp"}, {}, {"ucx_tls": "cma,tcp"}, {"ucx_tls": "^cma"},
                                     {"ucx_tls": "all"}, {"backend": "LIBFABRIC"}])
def test_over_tcp_both_lifetimes_cover_what_a_closed_socket_still_retransmits(
        options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer's process that ended, an agent destroyed, a connection UCX dropped: the socket is closed
    gracefully, its kernel retransmits what was queued for about 102 s (Linux's defaults), and the owner's UCX
    worker receives a put straight into the registered address when a partition heals meanwhile. Both lifetimes
    were shorter (30 s, 2 s). UCX left to choose (no ucx_tls, no UCX_TLS) may take TCP to another host; so may
    LIBFABRIC (its tcp provider)."""
    t = endpoint(options, monkeypatch=monkeypatch)
    horizon = orphan_retransmit_horizon()
    assert t.orphan_lifetime == horizon + 2.0
    assert t.write_lifetime == max(t.options.write_timeout, horizon + 2.0)
    assert NixlTransport.capabilities.orphan_lifetime == 2.0  # shared memory and RDMA: what was already sent


@pytest.mark.parametrize(("options", "environ"), [
    ({"ucx_tls": "cma"}, {}),
    ({"ucx_tls": "sm,self"}, {}),
    ({"ucx_tls": "rc,cuda_copy,cuda_ipc"}, {}),
    ({"ucx_tls": "^tcp"}, {}),
    ({}, {"UCX_TLS": "cma,self"}),  # what UCX reads where ucx_tls is unset
    ({"ucx_tls": "cma"}, {"UCX_TLS": "tcp"}),  # ucx_tls wins: the backend is created with it
])
def test_without_tcp_the_lifetimes_stay_short(options: dict[str, Any], environ: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    t = endpoint(dict(options, write_timeout=7.0), environ, monkeypatch)
    assert t.orphan_lifetime == 2.0 and t.write_lifetime == 7.0


def test_ucx_tls_from_the_environment_counts_where_the_option_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for tls, tcp in [("tcp", True), ("TCP,cma", True), ("^rc", True), ("^tcp,rc", False), ("tcp:aux,rc", True),
                     ("", True), ("posix,cma", False)]:
        assert NixlOptions.parse({}).may_use_tcp({"UCX_TLS": tls}) is tcp, tls


def test_tcp_orphan_seconds_sets_the_floor_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    t = endpoint({"ucx_tls": "tcp", "tcp_orphan_seconds": 1.0, "write_timeout": 10.0}, monkeypatch=monkeypatch)
    assert t.orphan_lifetime == 3.0 and t.write_lifetime == 10.0
    t = endpoint({"ucx_tls": "tcp", "tcp_orphan_seconds": 60, "write_timeout": 10.0}, monkeypatch=monkeypatch)
    assert t.orphan_lifetime == 62.0 and t.write_lifetime == 62.0
    t = endpoint({"ucx_tls": "tcp", "tcp_orphan_seconds": 0}, monkeypatch=monkeypatch)
    assert t.orphan_lifetime == 2.0
    for bad in (-1, float("nan"), True, "10", 86401):
        with pytest.raises(ConfigError, match="tcp_orphan_seconds"):
            NixlOptions.parse({"tcp_orphan_seconds": bad})
    assert NixlOptions.parse({"tcp_orphan_seconds": None}).tcp_orphan_seconds is None
