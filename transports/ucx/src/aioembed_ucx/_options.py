"""``transport_options`` of the UCX transport: parsed once, validated with named errors."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aioembed.errors import ConfigError
from aioembed.transports.option_names import refuse_unknown_options
from aioembed.transports.tcp_orphans import tcp_orphan_seconds_option

__all__ = ["EAGER_BYTES", "MAX_CONNECTIONS", "MAX_EAGER_BYTES", "PROGRESS_MODES", "UcxOptions", "tls_may_use_rdma"]

PROGRESS_MODES = ("blocking", "polling", "thread", "thread-polling")

_LOCAL_TLS = frozenset({
    "self", "tcp", "sm", "shm", "mm", "posix", "sysv", "xpmem", "cma", "knem", "sockcm",
    "cuda", "cuda_copy", "cuda_ipc", "gdr_copy", "rocm", "rocm_copy", "rocm_ipc", "rocm_gdr", "ze_copy", "ze_ipc",
    "ze_gdr",
})
"""UCX transports that move host memory without RDMA (TCP, shared memory) or only device memory; any other name
(``rc``, ``ud``, ``dc``, ``ib``, ``srd``, ``ugni``..., or one this list does not know) counts as RDMA."""
_RDMA_TLS = frozenset({
    "ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5",
    "dc", "dc_x", "dc_mlx5", "srd", "rdmacm", "ugni", "ugni_rdma", "ugni_udt", "ugni_smsg",
})
# UCX transport names accepted in UCX_TLS (UCX 1.1x-1.2x), including aliases and the
# meta names. A leading "^" negates the list, as in UCX itself.
_KNOWN_TLS = _LOCAL_TLS | _RDMA_TLS | {"all"}


def tls_may_use_rdma(tls: str | None, rdma_devices: bool) -> bool:
    """Whether UCX with this ``UCX_TLS`` setting may move host memory over RDMA, where a send from memory UCX has
    not registered costs it a registration (a pin): one such transport is named, or UCX chooses (no setting,
    ``all``, or an exclusion list) on a host with RDMA devices (``rdma_devices``)."""
    if not tls:
        return rdma_devices
    names = {n.strip().lower() for n in tls.removeprefix("^").split(",") if n.strip()}
    if tls.startswith("^") or "all" in names:
        return rdma_devices
    return bool(names - _LOCAL_TLS)



_UCX_KEY = re.compile(r"^[A-Z][A-Z0-9_]*$")

_KNOWN = ("tls", "host", "port", "progress_mode", "write_timeout", "connect_timeout", "inline_bytes",
          "eager_bytes", "ucx_options", "tcp_orphan_seconds", "max_connections")


EAGER_BYTES = 1 << 20
"""Default ``eager_bytes``: a 64-token request (460 KB) goes eagerly, a large chunk waits for the go-ahead
(whose round trip is small against its transfer)."""
MAX_EAGER_BYTES = 64 << 20

MAX_CONNECTIONS = 1024
"""Default ``max_connections``: a writer endpoint holds one connection per owner it writes to (briefly two while
it reconnects), so this is room for hundreds of encoder processes per receiver; past it a flood of connections
(a broken or hostile peer) is refused before it costs the owner sockets, UCX endpoints and tasks."""
_MAX_CONNECTIONS_LIMIT = 1 << 16


def _integer(name: str, value: object, low: int, high: int, meaning: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"transport_options.{name} must be an integer in [{low}, {high}]{meaning}, got {value!r}")
    return value


def _seconds(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ConfigError(f"transport_options.{name} must be a number of seconds, got {value!r}")
    if not 0 < value <= 86400:
        raise ConfigError(f"transport_options.{name}={value} is out of range; allowed: 0 < {name} <= 86400")
    return float(value)


@dataclass(frozen=True)
class UcxOptions:
    """Validated options; see the plugin README for what each one does."""

    tls: str | None = None
    """``UCX_TLS``: None leaves it to UCX (the ``UCX_TLS`` environment variable, else ``all``)."""
    host: str = "127.0.0.1"
    """Address this endpoint advertises in its descriptor (the listener binds every interface)."""
    port: int = 0
    """Listener port; 0 lets the OS choose."""
    progress_mode: str | None = None
    """ucxx progress mode; None: ``UCXPY_PROGRESS_MODE`` if set, else ``blocking``."""
    write_timeout: float = 30.0
    """Seconds one ``Link.write`` (and the matching receive on the owning side) may take."""
    connect_timeout: float = 10.0
    """Seconds to open a UCX endpoint to a peer and check that it is the announced one; as the owning side,
    the most an incoming connection may take for its UCX handshake before the listener closes it."""
    inline_bytes: int = 0
    """Ops of at most this many bytes (CPU to CPU) travel together in one message that the owning
    side copies into place; 0 sends every op as its own message straight into the pool."""
    eager_bytes: int = EAGER_BYTES
    """CPU-to-CPU writes of at most this many bytes go without the owner's go-ahead (one round trip
    instead of two); as the owning side, the most such a write may carry (announced in the
    descriptor; the writer uses the smaller of both). 0: every write waits for the go-ahead."""
    ucx_options: Mapping[str, str] = field(default_factory=dict)
    """Extra UCX settings without the ``UCX_`` prefix, e.g. ``{"RNDV_SCHEME": "put_zcopy"}``."""
    max_connections: int = MAX_CONNECTIONS
    """As the owning side, the most incoming connections open at once (handshaking or served); a further one is
    closed at once, with a rate-limited warning, and counted (``connections_refused``)."""
    tcp_orphan_seconds: float | None = None
    """Where UCX may use TCP (:func:`~aioembed.transports.tcp_orphans.ucx_tls_may_use_tcp`), how long a closed
    socket's bytes may still reach the owner; None: what this host's kernel retransmits
    (:func:`~aioembed.transports.tcp_orphans.orphan_retransmit_horizon`). The floor of both lifetimes (+ 2 s)."""

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> UcxOptions:
        if not isinstance(options, Mapping):
            raise ConfigError(f"transport_options must be a mapping, got {type(options).__name__}")
        refuse_unknown_options("ucx", options, _KNOWN)
        kw: dict[str, Any] = {}

        if (tls := options.get("tls")) is not None:
            if not isinstance(tls, str) or not tls.strip():
                raise ConfigError(f"transport_options.tls must be a UCX_TLS string such as 'tcp' or "
                                  f"'rc,cuda_copy,tcp', got {tls!r}")
            names = tls.strip().removeprefix("^").split(",")
            bad = [n for n in names if n.strip().lower() not in _KNOWN_TLS]
            if bad:
                raise ConfigError(f"transport_options.tls={tls!r}: unknown UCX transport(s) {bad}; "
                                  f"known: {sorted(_KNOWN_TLS)}")
            kw["tls"] = ",".join(n.strip().lower() for n in tls.strip().split(","))

        if "host" in options:
            host = options["host"]
            if not isinstance(host, str) or not host or host != host.strip() or len(host) > 253:
                raise ConfigError(f"transport_options.host must be an IP address or host name, got {host!r}")
            try:
                unspecified = ipaddress.ip_address(host).is_unspecified
            except ValueError:
                unspecified = False
                if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", host):
                    raise ConfigError(
                        f"transport_options.host={host!r} is neither an IP address nor a host name") from None
            if unspecified:
                raise ConfigError(f"transport_options.host={host!r} is not an address a peer can reach; "
                                  "give this machine's address on the network the sender uses")
            kw["host"] = host

        if "port" in options:
            port = options["port"]
            if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
                raise ConfigError(f"transport_options.port must be an integer in [0, 65535] "
                                  f"(0: any free port), got {port!r}")
            kw["port"] = port

        if (mode := options.get("progress_mode")) is not None:
            if mode not in PROGRESS_MODES:
                raise ConfigError(f"transport_options.progress_mode must be one of {list(PROGRESS_MODES)}, "
                                  f"got {mode!r}")
            kw["progress_mode"] = mode

        for name in ("write_timeout", "connect_timeout"):
            if name in options:
                kw[name] = _seconds(name, options[name])

        for name, low, high, meaning in (("inline_bytes", 0, 1 << 20, ""), ("eager_bytes", 0, MAX_EAGER_BYTES, ""),
                                         ("max_connections", 1, _MAX_CONNECTIONS_LIMIT,
                                          " (incoming connections open at once)")):
            if name in options:
                kw[name] = _integer(name, options[name], low, high, meaning)

        if (orphan := tcp_orphan_seconds_option(options)) is not None:
            kw["tcp_orphan_seconds"] = orphan

        if "ucx_options" in options:
            extra = options["ucx_options"]
            if not isinstance(extra, Mapping):
                raise ConfigError(f"transport_options.ucx_options must be a mapping of UCX setting names "
                                  f"(without the UCX_ prefix) to strings, got {extra!r}")
            clean: dict[str, str] = {}
            for k, v in extra.items():
                if not isinstance(k, str) or not _UCX_KEY.match(k) or k.startswith("UCX_"):
                    raise ConfigError(f"transport_options.ucx_options: bad key {k!r}; use UCX names without "
                                      "the UCX_ prefix, e.g. 'RNDV_SCHEME'")
                if k == "TLS":
                    raise ConfigError("transport_options.ucx_options must not set TLS; use transport_options.tls")
                if not isinstance(v, (str, int)) or isinstance(v, bool):
                    raise ConfigError(f"transport_options.ucx_options[{k!r}] must be a string, got {v!r}")
                clean[k] = str(v)
            kw["ucx_options"] = clean

        return cls(**kw)

    def cuda_problem(self, environ: Mapping[str, str]) -> str | None:
        """Why these options cannot move CUDA memory, or None if they can (or UCX decides)."""
        tls = self.tls if self.tls is not None else environ.get("UCX_TLS")
        if not tls:
            return None  # UCX picks among every transport it has, CUDA ones included
        setting = "transport_options.tls" if self.tls is not None else "the UCX_TLS environment variable"
        names = {n.strip().lower() for n in tls.removeprefix("^").split(",")}
        cuda = {"cuda", "cuda_copy", "cuda_ipc", "gdr_copy"}
        if tls.startswith("^"):
            if {"cuda_copy", "cuda_ipc"} <= names or "cuda" in names:
                return f"{setting}={tls!r} excludes the CUDA transports"
            return None
        if "all" in names or names & cuda:
            return None
        return (f"{setting}={tls!r} has no CUDA transport: add cuda_copy (and cuda_ipc for GPUs of one "
                f"host), e.g. {tls + ',cuda_copy,cuda_ipc'!r}")

    def context_key(self) -> tuple[str | None, str | None, tuple[tuple[str, str], ...]]:
        """The settings that are per process in UCX (one context per process)."""
        return (self.tls, self.progress_mode, tuple(sorted(self.ucx_options.items())))
