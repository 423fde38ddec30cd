"""Loading and starting ``mooncake.engine.TransferEngine``: the blocking, process-global parts.

Everything here is synchronous; the transport calls it from worker threads.

The engine reads its settings from environment variables at several moments: ``MC_LOG_LEVEL``
when ``mooncake.engine`` is imported, ``MC_TRANSFER_TIMEOUT`` when a ``TransferEngine`` is
constructed, ``MC_FORCE_TCP`` in ``initialize()`` (whether it exists: any value forces TCP), and the
TCP transport's timeouts (``MC_TCP_PROGRESS_TIMEOUT_SEC``, ``MC_TCP_STATUS_TIMEOUT_SEC``) on its own
threads, for every transfer (measured on 0.3.13.post1: set for the process, a write to a stopped peer
ended after the value set; set only around ``initialize()``, or only around the submit, after the
default 30 s).

The threads of a running engine call ``getenv()``, which takes no lock: adding a variable may move
the C environment array (the old one is freed) and removing one shifts the entries after it, so a
concurrent ``getenv()`` can read freed memory or miss a variable. Replacing the value of a variable
that exists only swaps one pointer (glibc never frees the old string). So :func:`start_engine` adds
or removes a variable only while no engine of this process exists, and otherwise only replaces
values: ``MC_FORCE_TCP`` is set (or removed) for the process by the first engine that needs it and
a later endpoint that would need the other state while engines run is refused; ``MC_TRANSFER_TIMEOUT``
is swapped in around one engine's construction and back (to ``30``, the engine's default, where the
user had not set it: it stays, so later endpoints can swap theirs in); the TCP timeouts are set once,
for the process while no engine exists: the first endpoint that asks decides them. What the plugin
added, removed or swapped is put back once no engine of the process exists.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import re
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from aioembed.errors import ConfigError, TransportError

__all__ = [
    "DISTRIBUTIONS",
    "MIN_ENGINE_VERSION",
    "INSTALL_HINT",
    "EngineSettings",
    "StartedEngine",
    "cuda_build_installed",
    "installed_engine",
    "load_engine_module",
    "destroy_engine",
    "rdma_devices",
    "start_engine",
    "tcp_lanes_per_peer",
]

log = logging.getLogger("aioembed_mooncake")

MIN_ENGINE_VERSION = (0, 3, 12)
"""First release whose TCP write returns only once the data has arrived at the peer."""

DISTRIBUTIONS = {
    "mooncake-transfer-engine-non-cuda": "non-cuda",
    "mooncake-transfer-engine": "cuda12",
    "mooncake-transfer-engine-cuda13": "cuda13",
}
"""Engine wheels on PyPI and the ``aioembed-mooncake`` extra that installs each."""

INSTALL_HINT = (
    "install an engine build with `pip install 'aioembed-mooncake[non-cuda]'` "
    "(or `[cuda12]` / `[cuda13]` on a CUDA host; install only one of them) and the system libraries "
    "it links with `apt-get install -y libibverbs1 libnuma1 libcurl4` (needed even for TCP)"
)

INFINIBAND_SYSFS = Path("/sys/class/infiniband")

_ENV_LOCK = threading.Lock()
_IMPORT_LOCK = threading.Lock()
_loaded: list[Any] = []  # the imported module, once


def installed_engine() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed engine wheel, or None."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def cuda_build_installed() -> bool:
    """True if the installed engine wheel is a CUDA build (read from package metadata, no import)."""
    found = installed_engine()
    return found is not None and found[0] != "mooncake-transfer-engine-non-cuda"


def _version_tuple(version: str) -> tuple[int, ...]:
    m = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def load_engine_module() -> Any:
    """Import ``mooncake.engine`` once (quietly), checking the version; ``TransportError`` if impossible."""
    with _IMPORT_LOCK:
        if _loaded:
            return _loaded[0]
        found = installed_engine()
        if found is not None and _version_tuple(found[1]) < MIN_ENGINE_VERSION:
            want = ".".join(map(str, MIN_ENGINE_VERSION))
            raise TransportError(
                f"mooncake transport: {found[0]} {found[1]} is too old; version {want} or later is required "
                f"(earlier TCP writes can return before the data has arrived); "
                f"`pip install -U '{found[0]}>={want}'`"
            )
        # glog reads MC_LOG_LEVEL once, when the extension is loaded. Keep the default quiet
        # (about 20 INFO/WARNING lines per engine otherwise) unless the user chose a level.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            mod = importlib.import_module("mooncake.engine")
        except ImportError as exc:
            which = f"{found[0]} {found[1]} is installed but " if found else "no engine wheel is installed: "
            extra = ""
            if "libcudart" in str(exc) or "libcuda" in str(exc):
                extra = (
                    " This is a CUDA build of the engine, and the CUDA runtime is missing; on a host "
                    "without CUDA use the non-CUDA build instead."
                )
            raise TransportError(
                f"mooncake transport: cannot import mooncake.engine ({which}{exc}).{extra} To fix: {INSTALL_HINT}"
            ) from exc
        if found is None:
            log.warning("mooncake.engine imported, but no engine distribution metadata was found; "
                        "cannot check that the engine is %s or later", ".".join(map(str, MIN_ENGINE_VERSION)))
        _loaded.append(mod)
        return mod


def rdma_devices() -> list[str]:
    """Names of the RDMA devices of this host (``/sys/class/infiniband``), sorted."""
    try:
        return sorted(p.name for p in INFINIBAND_SYSFS.iterdir())
    except OSError:
        return []


@dataclass(frozen=True)
class EngineSettings:
    """What :func:`start_engine` needs; validated by the transport."""

    hostname: str
    metadata_server: str
    protocol: str  # "rdma" or "tcp": already resolved from "auto"
    device_name: str
    transfer_timeout: int | None  # seconds; None: leave the engine's setting alone


@dataclass
class StartedEngine:
    engine: Any
    session: str
    rpc_port: int
    transfer_timeout: int = 30
    """Seconds: the timeout the engine took from ``MC_TRANSFER_TIMEOUT`` when it was constructed."""
    lane_timeout: int = 30
    """Seconds: ``MC_TCP_PROGRESS_TIMEOUT_SEC`` as the engine's TCP lanes read it (process-wide, fixed
    while engines run)."""
    tcp_lanes: int = 0
    """Connections the engine's TCP transport keeps open per peer (see :func:`tcp_lanes_per_peer`)."""


FORCE_TCP = "MC_FORCE_TCP"
TRANSFER_TIMEOUT_VARIABLE = "MC_TRANSFER_TIMEOUT"
ENGINE_DEFAULT_TIMEOUT = 30
"""Seconds: the engine's transfer timeout and its TCP lanes' timeouts where their variables are unset."""

_live_engines: weakref.WeakSet[Any] = weakref.WeakSet()
"""Engines of this process that still exist: while one does, its threads may read the environment (an
engine's own threads end in its destructor; measured on 0.3.13.post1, two per TCP engine)."""


_USERS: dict[str, str | None] = {}
"""What the user had in the variables the plugin added, removed or swapped while no engine existed (None:
unset): put back once the last engine is gone (no engine thread reads the environment then), so that processes
started later do not inherit the plugin's choices (an ``MC_FORCE_TCP`` forces every engine of a child to TCP)."""


def _restore_if_no_engine() -> None:
    """Under ``_ENV_LOCK``: with no engine left, the environment is the user's again."""
    if _live_engines or not _USERS:
        return
    for name, value in _USERS.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _USERS.clear()


def _c_atoi(text: str | None) -> int:
    """C's ``atoi()``, as the engine parses these variables: leading digits, 0 if none."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?\d+)", text or "")
    return max(-(1 << 31), min(int(m.group(1)), (1 << 31) - 1)) if m else 0


def engine_transfer_timeout(value: str | None) -> int:
    """The timeout (seconds) an engine constructed with ``MC_TRANSFER_TIMEOUT=value`` uses (None: unset)."""
    return ENGINE_DEFAULT_TIMEOUT if value is None else max(5, _c_atoi(value))


def lane_timeout(value: str | None) -> int:
    """The timeout (seconds) the engine's TCP lanes use for ``MC_TCP_PROGRESS_TIMEOUT_SEC=value``."""
    v = _c_atoi(value)
    return v if v > 0 else ENGINE_DEFAULT_TIMEOUT


def _engines_alive() -> int:
    """How many engines of this process exist; closed endpoints caught in reference cycles are collected
    first (called only where the answer would refuse or degrade something)."""
    if _live_engines:
        gc.collect()
    return len(_live_engines)


def _set_force_tcp(protocol: str) -> None:
    """Make ``MC_FORCE_TCP`` exist exactly when ``protocol`` is TCP: the engine tests only whether it exists,
    in ``initialize()``. Changed only while no engine of this process exists (it then stays, for the
    engines it started); otherwise a different need is a ``ConfigError`` naming what is set."""
    want = protocol == "tcp"
    current = os.environ.get(FORCE_TCP)
    if (current is not None) == want:
        return
    running = _engines_alive()
    if running:
        if want:
            need, state = (f"{FORCE_TCP} set while its engine initializes (without it the engine installs RDMA "
                           "on a host with RDMA devices)", "unset (an endpoint with protocol 'rdma' opened first)")
        else:
            need, state = (f"{FORCE_TCP} unset while its engine initializes (the engine tests only whether it "
                           "exists: any value forces TCP)",
                           f"set ({FORCE_TCP}={current!r}: by the user or an endpoint with protocol 'tcp')")
        raise ConfigError(
            f"mooncake transport: transport_options.protocol={protocol!r} needs {need}, but it is {state} and "
            f"{running} engine(s) of this process are running; their threads read the environment, so it is "
            "not changed while they run. Use one protocol per process, or close (and drop) the other "
            "endpoints first"
        )
    _USERS.setdefault(FORCE_TCP, current)
    if want:
        os.environ[FORCE_TCP] = "1"
    else:
        log.info("mooncake transport: protocol %r: removing %s=%r from the environment (it would force TCP)",
                 protocol, FORCE_TCP, current)
        del os.environ[FORCE_TCP]


@contextmanager
def _transfer_timeout(seconds: int | None) -> Iterator[None]:
    """``MC_TRANSFER_TIMEOUT`` for constructing one engine (the engine reads it only then). Swapped in and
    back, to the user's value or to the engine's default where the user set none (the variable stays, so
    later endpoints can swap theirs in while engines run); added only while no engine exists."""
    if seconds is None:
        yield
        return
    current = os.environ.get(TRANSFER_TIMEOUT_VARIABLE)
    if current is None and (running := _engines_alive()):
        log.warning("mooncake transport: transfer_timeout=%d s does not reach the engine's own timeout (%s, "
                    "which bounds its synchronous reads, such as connect()'s): it is unset in this process and "
                    "not added while %d engine(s) run (their threads read the environment), so this engine keeps "
                    "its default, %d s; the endpoint's writes still give up after %d s",
                    seconds, TRANSFER_TIMEOUT_VARIABLE, running, ENGINE_DEFAULT_TIMEOUT, seconds)
        yield
        return
    if current is None:
        _USERS.setdefault(TRANSFER_TIMEOUT_VARIABLE, None)
    os.environ[TRANSFER_TIMEOUT_VARIABLE] = str(seconds)
    try:
        yield
    finally:
        os.environ[TRANSFER_TIMEOUT_VARIABLE] = current if current is not None else str(ENGINE_DEFAULT_TIMEOUT)


TCP_TIMEOUT_VARIABLES = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")


def _set_tcp_timeouts(seconds: int) -> None:
    """Let the TCP lanes give up on a stalled peer as soon as the caller does, so that a write reported as
    failed stops moving bytes (and is settled) as early as the engine allows. The engine's threads read
    these per transfer, so they are set for the process and only while no engine of it exists (put back
    with the others once none does); a value already there (the user's, or an earlier endpoint's) is kept,
    and a different wish is logged."""
    for name in TCP_TIMEOUT_VARIABLES:
        current = os.environ.get(name)
        if current is None and not _engines_alive():
            _USERS.setdefault(name, None)
            os.environ[name] = str(seconds)
        elif current != str(seconds):
            log.warning("mooncake transport: transfer_timeout=%d s, but the engine's TCP lanes drop a stalled peer "
                        "after %s=%s (set for the process before this endpoint; the engine reads it on its own "
                        "threads, so it is not changed while engines run)", seconds, name,
                        current if current is not None else "unset: the engine's default, 30 s")


POOLED_TCP_SINCE = (0, 3, 13)
"""First release whose TCP transport pools its connections (per-peer lanes) unless
``MC_TCP_ENABLE_CONNECTION_POOL`` turns that off; before, it pooled only when that variable asked."""
_DEFAULT_LANES, _MAX_LANES = 4, 16


def _lanes_setting(value: str) -> int:
    """The engine's parse of ``MC_TCP_LANES_PER_PEER``: decimal digits in [1, 16], else its default 4."""
    if value.isascii() and value.isdigit() and 1 <= int(value) <= _MAX_LANES:
        return int(value)
    return _DEFAULT_LANES


def tcp_lanes_per_peer(version: str | None = None) -> int:
    """How many connections the engine's TCP transport keeps open to each peer it wrote to or read from, as
    it reads the environment when an engine initializes; 0 where it keeps none (its pool disabled: one
    connection per transfer, closed after it).

    Measured on 0.3.13.post1 (TCP over loopback): a lane opens when a transfer needs one, stays open while
    idle, and is closed only by a transfer that fails on it (or by the engine's destruction). A lane whose
    peer died while it was idle keeps its socket in CLOSE-WAIT for good: the engine notices nothing until
    it sends on it again, and the next peer process has another port, so nothing ever does. Each failed
    transfer closes the one lane it ran on (``tcp_transport_lane_impl.h``, ``handleLaneTerminal``).
    """
    if version is None:
        found = installed_engine()
        version = found[1] if found is not None else None
    pool = os.environ.get("MC_TCP_ENABLE_CONNECTION_POOL")
    if pool is None:
        # No metadata (an unusual install): assume the current engines' default, the pool.
        pooled = version is None or _version_tuple(version) >= POOLED_TCP_SINCE
    else:
        pooled = pool.lower() not in ("0", "false", "no")
    if not pooled:
        return 0
    for name in ("MC_TCP_LANES_PER_PEER", "MC_TCP_MAX_CONNECTIONS_PER_PEER"):  # the second: deprecated name
        value = os.environ.get(name)
        if value is not None:
            return _lanes_setting(value)
    return _DEFAULT_LANES


def start_engine(settings: EngineSettings) -> StartedEngine:
    """Construct and initialize an engine (blocking; run it in a worker thread)."""
    mod = load_engine_module()
    with _ENV_LOCK:
        # The `protocol` argument of initialize() does not choose the transport: the engine
        # installs RDMA whenever it finds an HCA. Only MC_FORCE_TCP really forces TCP.
        _set_force_tcp(settings.protocol)
        if settings.transfer_timeout is not None:
            _set_tcp_timeouts(settings.transfer_timeout)
        with _transfer_timeout(settings.transfer_timeout):
            engine = mod.TransferEngine()
            transfer_timeout = engine_transfer_timeout(os.environ.get(TRANSFER_TIMEOUT_VARIABLE))
        lanes = tcp_lanes_per_peer() if settings.protocol == "tcp" else 0  # read by initialize(), just below
        _live_engines.add(engine)  # before initialize(), which starts its threads
        rc = engine.initialize(settings.hostname, settings.metadata_server, settings.protocol, settings.device_name)
        if rc != 0:
            raise TransportError(
                f"mooncake transport: TransferEngine.initialize(hostname={settings.hostname!r}, "
                f"metadata_server={settings.metadata_server!r}, protocol={settings.protocol!r}, "
                f"device_name={settings.device_name!r}) returned {rc}"
                + ("" if settings.metadata_server == "P2PHANDSHAKE"
                   else "; is the metadata server reachable? (the default 'P2PHANDSHAKE' needs none)")
            )
        lanes_timeout = lane_timeout(os.environ.get(TCP_TIMEOUT_VARIABLES[0]))
    # Only now is the engine safe to query: get_rpc_port() before initialize() segfaults.
    port = int(engine.get_rpc_port())
    p2p = settings.metadata_server == "P2PHANDSHAKE"
    session = f"{settings.hostname}:{port}" if p2p else settings.hostname
    return StartedEngine(engine=engine, session=session, rpc_port=port, transfer_timeout=transfer_timeout,
                         lane_timeout=lanes_timeout, tcp_lanes=lanes)


def _listening_fds(port: int) -> list[int]:
    """File descriptors of this process's listening TCP sockets on ``port``."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            s = socket.socket(fileno=dup)  # the socket object owns (and closes) the duplicate
        except OSError:
            os.close(dup)
            continue
        with s:
            try:
                if (s.type == socket.SOCK_STREAM and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                        and s.family in (socket.AF_INET, socket.AF_INET6) and s.getsockname()[1] == port):
                    out.append(int(name))
            except OSError:
                pass
    return out


def _hasten_destruction(rpc_port: int) -> None:
    """Make the engine's destructor return in milliseconds instead of about one second.

    The destructor joins the handshake listener thread, which sits in ``accept()`` with a
    one-second receive timeout and checks its stop flag only between calls; meanwhile the
    destructor holds the GIL, so the whole interpreter stalls. Lowering the listener's timeout
    to 5 ms and waking the blocked ``accept()`` with one empty connection lets the thread see
    the flag at once. Best effort: on any failure the destructor just takes its usual second.
    """
    try:
        fds = _listening_fds(rpc_port)
        for fd in fds:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 5000))
        if fds:
            with socket.create_connection(("127.0.0.1", rpc_port), timeout=0.5):
                pass
            time.sleep(0.01)  # let the listener take the connection and start a 5 ms accept()
    except OSError:
        pass


def destroy_engine(box: list[Any], rpc_port: int) -> None:
    """Destroy the engine held (only) in ``box`` (blocking; run it in a worker thread).

    The engine has no ``close()``: its destructor runs when the last Python reference goes,
    closing its listeners, lanes and segments.
    """
    _hasten_destruction(rpc_port)
    box.clear()
    with _ENV_LOCK:
        _restore_if_no_engine()
