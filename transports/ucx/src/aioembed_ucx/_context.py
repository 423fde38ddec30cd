"""The one ucxx context of this process: imported lazily, initialised once, shared.

UCX is initialised per process (ucxx keeps a module-global context with one worker), so
every :class:`~aioembed_ucx.UcxTransport` of a process shares it. The settings that are
per process (``tls``, ``progress_mode``, ``ucx_options``) are fixed by the first endpoint
opened; a later endpoint asking for different ones is a ``ConfigError``.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import os
import sys
import threading
from typing import Any

from aioembed.errors import ConfigError, TransportError
from aioembed.transports.native_libraries import preload_shared_libraries

from aioembed_ucx._options import UcxOptions
from aioembed_ucx._progress import install_armed_progress

__all__ = ["DEFAULT_PROGRESS_MODE", "INSTALL_HINT", "ensure_context", "load_ucxx"]

log = logging.getLogger("aioembed.transports.ucx")

INSTALL_HINT = ("pip install 'aioembed-ucx[cu12]' (CUDA 12 wheels) or 'aioembed-ucx[cu13]' (CUDA 13); "
                "both work on machines without a GPU")
DEFAULT_PROGRESS_MODE = "blocking"



class _State:
    """What this process initialised UCX with (guarded by ``lock``)."""

    lock = threading.Lock()
    key: tuple[Any, ...] | None = None
    pid: int | None = None


# What the libucx wheel's loader opens, in its order (``libucx.load``); ucxx then links against them.
_UCX_WHEEL_LIBRARIES = ("libucs.so", "libucs_signal.so", "libuct.so", "libucp.so")


def _preload_wheel_ucx() -> None:
    """Load the libucx wheel's libraries with the GIL released (0.4 s of UCX constructors, which the
    wheel's own ``ctypes.CDLL`` runs holding the GIL: the event loop stood still that long at every
    process's first ``open``, 2-3 s on a loaded host)."""
    if os.getenv("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false").lower() != "false":
        return  # the wheel's loader may pick a system UCX instead: load nothing it might not
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return
    lib = os.path.join(next(iter(spec.submodule_search_locations)), "lib")
    paths = [os.path.join(lib, name) for name in _UCX_WHEEL_LIBRARIES]
    if not all(os.path.isfile(p) for p in paths):
        return
    for problem in preload_shared_libraries(paths):
        log.debug("ucx: preloading %s (ucxx's import loads it itself)", problem)


def load_ucxx() -> Any:
    """Import ucxx, or raise a ``ConfigError`` that names the pip extra to install. The first call loads
    UCX's native libraries (~0.7 s): make it from a worker thread, the GIL is released meanwhile."""
    # UCX warns about variables that ucxx sets for CUDA builds and UCX 1.21 ignores.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if "ucxx" not in sys.modules:
        _preload_wheel_ucx()
    try:
        ucxx = importlib.import_module("ucxx")  # untyped; imported lazily on purpose
    except ImportError as exc:
        raise ConfigError(f"transport 'ucx' needs the ucxx package, which is not importable ({exc}); "
                          f"{INSTALL_HINT}") from exc
    return ucxx


def context_settings(ucxx: Any) -> tuple[str, str]:
    """The live UCX context's TLS setting and progress mode (what it was made with, by this plugin or another
    user of ucxx in the process; the environment may have changed since)."""
    return str(ucxx.get_config().get("TLS", "all")), str(ucxx.core._get_ctx().progress_mode)


def _effective_mode(opts: UcxOptions) -> str:
    return opts.progress_mode or os.environ.get("UCXPY_PROGRESS_MODE") or DEFAULT_PROGRESS_MODE


def ensure_context(opts: UcxOptions) -> Any:
    """Initialise ucxx for this process with ``opts`` (first call) or check they match; in ``blocking``
    mode, the running loop's progress is an :class:`~aioembed_ucx._progress.ArmedProgress`."""
    ucxx = _ensure_initialised(opts)
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop yet: the next call from one installs its progress
        return ucxx
    install_armed_progress(ucxx)
    return ucxx


def _ensure_initialised(opts: UcxOptions) -> Any:
    ucxx = load_ucxx()
    mode = _effective_mode(opts)
    key = (opts.tls, mode, tuple(sorted(opts.ucx_options.items())))
    with _State.lock:
        if _State.pid is not None and _State.pid != os.getpid():
            # Forked after UCX was initialised: the inherited context is unusable.
            try:
                ucxx.reset()
            except Exception as exc:
                raise TransportError(f"UCX was initialised in parent process {_State.pid} before a fork and cannot be "
                                     f"reset here ({exc}); start workers with the 'spawn' method") from exc
            _State.key = _State.pid = None
        if _State.key is not None:
            if key != _State.key:
                raise ConfigError(
                    "UCX is initialised once per process and this process already uses "
                    f"tls={_State.key[0]!r}, progress_mode={_State.key[1]!r}, ucx_options={dict(_State.key[2])!r}; "
                    f"this endpoint asks for tls={key[0]!r}, progress_mode={key[1]!r}, "
                    f"ucx_options={dict(key[2])!r}: give every ucx endpoint of a process the same values")
            return ucxx
        core = ucxx.core
        if core._ctx is not None:
            # Someone else initialised ucxx in this process: accept it if it fits.
            have_mode = core._ctx.progress_mode
            have_tls = str(ucxx.get_config().get("TLS", ""))
            if (opts.progress_mode and opts.progress_mode != have_mode) or (
                    opts.tls and opts.tls != have_tls) or opts.ucx_options:
                raise ConfigError(f"ucxx was already initialised in this process (tls={have_tls!r}, "
                                  f"progress_mode={have_mode!r}) with other settings than transport_options ask "
                                  f"for (tls={opts.tls!r}, progress_mode={opts.progress_mode!r}, "
                                  f"ucx_options={dict(opts.ucx_options)!r})")
            _State.key, _State.pid = key, os.getpid()
            return ucxx
        # A listener restarted on a fixed port must not wait out the last process's TIME_WAIT sockets
        # (about a minute without it: "Device is busy"). ``ucx_options`` may still say otherwise.
        ucx_opts = {"CM_REUSEADDR": "y", **opts.ucx_options}
        if opts.tls is not None:
            ucx_opts["TLS"] = opts.tls
        try:
            ucxx.init(options=ucx_opts, progress_mode=mode)
        except Exception as exc:
            raise ConfigError(f"cannot initialise UCX with tls={opts.tls!r}, progress_mode={mode!r}, "
                              f"ucx_options={dict(opts.ucx_options)!r}: {exc}") from exc
        _State.key, _State.pid = key, os.getpid()
        return ucxx
