"""``transport_options`` of the NIXL transport: parsed once, validated with errors that name the option."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aioembed.errors import ConfigError
from aioembed.transports.option_names import refuse_unknown_options
from aioembed.transports.tcp_orphans import orphan_horizon, tcp_orphan_seconds_option, ucx_tls_may_use_tcp

__all__ = ["NETWORK_BACKENDS", "NixlOptions"]

NETWORK_BACKENDS = ("UCX", "LIBFABRIC")
"""NIXL backends that write from one agent's memory into another agent's (the others in a NIXL build,
such as POSIX, GDS or OBJ, move data to storage). Only UCX is tested here."""

# UCX transport names accepted in UCX_TLS (UCX 1.1x-1.2x), including aliases and the meta names.
_KNOWN_TLS = frozenset({
    "all", "self", "tcp", "sm", "shm", "mm", "posix", "sysv", "xpmem", "cma", "knem",
    "ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5",
    "dc", "dc_x", "dc_mlx5", "srd", "rdmacm", "sockcm",
    "cuda", "cuda_copy", "cuda_ipc", "gdr_copy", "rocm", "rocm_copy", "rocm_ipc", "rocm_gdr",
})
_UCX_KEY = re.compile(r"^[A-Z][A-Z0-9_]*$")
_PARAM_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_KNOWN = ("backend", "backend_params", "ucx_tls", "ucx_options", "progress_delay", "write_timeout",
          "tcp_orphan_seconds")


def _seconds(name: str, value: object, lo: float, hi: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ConfigError(f"transport_options.{name} must be a number of seconds, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"transport_options.{name}={value} is out of range; allowed: {lo} <= {name} <= {hi}")
    return float(value)


def _setting(name: str, key: object, value: object) -> tuple[str, str]:
    """One ``key: value`` of a string-valued settings table (numbers and booleans become strings)."""
    if not isinstance(value, (str, int, float)) or (isinstance(value, float) and math.isnan(value)):
        raise ConfigError(f"transport_options.{name}[{key!r}] must be a string, number or boolean, got {value!r}")
    if isinstance(value, bool):
        return str(key), "true" if value else "false"
    return str(key), str(value)


@dataclass(frozen=True)
class NixlOptions:
    """Validated options; see the plugin README for what each one does."""

    backend: str = "UCX"
    """The NIXL backend (plugin) that moves the bytes."""
    backend_params: Mapping[str, str] = field(default_factory=dict)
    """Initialisation parameters of the backend (``create_backend``), e.g. ``{"num_workers": "2"}``;
    the keys are checked against the backend's own list when the endpoint opens."""
    ucx_tls: str | None = None
    """``UCX_TLS`` for this endpoint's UCX context; None leaves it to UCX (``UCX_TLS`` if set, else all)."""
    ucx_options: Mapping[str, str] = field(default_factory=dict)
    """Other UCX settings, without the ``UCX_`` prefix (e.g. ``{"RNDV_SCHEME": "put_zcopy"}``)."""
    progress_delay: float = 0.05
    """Seconds NIXL's progress thread sleeps at most between two looks at UCX when no event wakes it
    (``nixlAgentConfig.pthrDelay``). NIXL's Python API hard-codes 0 there, which spins a core."""
    write_timeout: float = 30.0
    """Seconds a ``Link.write`` may take before it fails (its transfer cannot be cancelled: see README)."""
    tcp_orphan_seconds: float | None = None
    """Where the backend may move bytes over TCP (:meth:`may_use_tcp`), how long a closed socket's bytes may still
    reach the owner; None: what this host's kernel retransmits
    (:func:`~aioembed.transports.tcp_orphans.orphan_retransmit_horizon`). The floor of both lifetimes (+ 2 s)."""

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> NixlOptions:
        if not isinstance(options, Mapping):
            raise ConfigError(f"nixl transport_options must be a mapping, got {type(options).__name__}")
        refuse_unknown_options("nixl", options, _KNOWN)
        kw: dict[str, Any] = {}

        if "backend" in options:
            backend = options["backend"]
            if not isinstance(backend, str) or backend.upper() not in NETWORK_BACKENDS:
                raise ConfigError(f"transport_options.backend must be one of {list(NETWORK_BACKENDS)} (NIXL backends "
                                  f"that write into another agent's memory), got {backend!r}")
            kw["backend"] = backend.upper()

        if "backend_params" in options:
            params = options["backend_params"]
            if not isinstance(params, Mapping):
                raise ConfigError(f"transport_options.backend_params must be a mapping of the backend's "
                                  f"initialisation parameters to strings, got {params!r}")
            clean: dict[str, str] = {}
            for k, v in params.items():
                if not isinstance(k, str) or not _PARAM_KEY.match(k):
                    raise ConfigError(f"transport_options.backend_params: bad key {k!r}")
                key, value = _setting("backend_params", k, v)
                clean[key] = value
            kw["backend_params"] = clean

        ucx_keys = [k for k in ("ucx_tls", "ucx_options") if k in options]
        if ucx_keys and kw.get("backend", "UCX") != "UCX":
            raise ConfigError(f"transport_options.{ucx_keys[0]} applies to backend 'UCX' only, "
                              f"not {kw['backend']!r}")

        if (tls := options.get("ucx_tls")) is not None:
            if not isinstance(tls, str) or not tls.strip():
                raise ConfigError(f"transport_options.ucx_tls must be a UCX_TLS string such as 'tcp' or "
                                  f"'cma,tcp', got {tls!r}")
            names = [n.strip().lower() for n in tls.strip().removeprefix("^").split(",")]
            bad = [n for n in names if n not in _KNOWN_TLS]
            if bad:
                raise ConfigError(f"transport_options.ucx_tls={tls!r}: unknown UCX transport(s) {bad}; "
                                  f"known: {sorted(_KNOWN_TLS)}")
            kw["ucx_tls"] = ("^" if tls.strip().startswith("^") else "") + ",".join(names)

        if "ucx_options" in options:
            extra = options["ucx_options"]
            if not isinstance(extra, Mapping):
                raise ConfigError(f"transport_options.ucx_options must be a mapping of UCX setting names "
                                  f"(without the UCX_ prefix) to strings, got {extra!r}")
            ucx: dict[str, str] = {}
            for k, v in extra.items():
                if not isinstance(k, str) or not _UCX_KEY.match(k) or k.startswith("UCX_"):
                    raise ConfigError(f"transport_options.ucx_options: bad key {k!r}; use UCX names without "
                                      "the UCX_ prefix, e.g. 'RNDV_SCHEME'")
                if k == "TLS":
                    raise ConfigError("transport_options.ucx_options must not set TLS; use transport_options.ucx_tls")
                key, value = _setting("ucx_options", k, v)
                ucx[key] = value
            kw["ucx_options"] = ucx

        if "progress_delay" in options:
            kw["progress_delay"] = _seconds("progress_delay", options["progress_delay"], 0.001, 10.0)
        if "write_timeout" in options:
            kw["write_timeout"] = _seconds("write_timeout", options["write_timeout"], 0.01, 86400.0)
        if (orphan := tcp_orphan_seconds_option(options)) is not None:
            kw["tcp_orphan_seconds"] = orphan
        return cls(**kw)

    def may_use_tcp(self, environ: Mapping[str, str]) -> bool:
        """Whether the backend may move a write's bytes over TCP, where a closed socket's kernel still delivers
        what was queued (see :mod:`aioembed.transports.tcp_orphans`). UCX: its transports are ``ucx_tls``, else
        ``UCX_TLS`` in ``environ`` (what UCX reads when the backend is created), else all of them; TCP may be
        used where that list names ``tcp`` or ``all``, or is an exclusion list (``^...``) that does not exclude
        ``tcp``. Unset, UCX picks per peer (shared memory on one host, TCP between hosts without RDMA), which the
        endpoint cannot know in advance: counted as TCP. LIBFABRIC: it picks a provider itself (``tcp`` among
        them), which the plugin cannot see: counted as TCP too."""
        if self.backend != "UCX":
            return True
        return ucx_tls_may_use_tcp(self.ucx_tls if self.ucx_tls is not None else environ.get("UCX_TLS"))

    def orphan_horizon(self, environ: Mapping[str, str]) -> float | None:
        """Seconds a closed TCP socket's bytes may still reach the owner (``tcp_orphan_seconds``, else this host's
        kernel's retransmission horizon), or None where the backend does not use TCP."""
        return orphan_horizon(self.tcp_orphan_seconds) if self.may_use_tcp(environ) else None

    def environment(self) -> dict[str, str]:
        """The ``UCX_*`` variables the backend must see when it is created."""
        env = {f"UCX_{k}": v for k, v in self.ucx_options.items()}
        if self.ucx_tls is not None:
            env["UCX_TLS"] = self.ucx_tls
        return env
