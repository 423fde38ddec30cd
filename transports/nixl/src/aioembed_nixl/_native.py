"""Loading a NIXL build and creating an agent: the parts of NIXL's Python API that need care.

* **Which module.** PyPI has one build per CUDA major version, each its own module (``nixl_cu12``,
  ``nixl_cu13``); the ``nixl`` meta package installs both and re-exports one. This plugin takes the
  meta package if present, else the build matching torch's CUDA version, else whichever is installed.
* **stdout.** NIXL's Python logger writes to *stdout* (and its import sets ``logging.raiseExceptions``
  for the whole process). A library must not write to a program's stdout (it corrupts protocols on it,
  e.g. JSON lines), so the handler is removed and records propagate to the application's logging; the
  global flag is restored.
* **The progress thread.** ``nixl_agent()`` hard-codes ``pthrDelay = 0``, and the UCX backend's progress
  thread then calls ``poll()`` with a zero timeout: a busy loop, measured at 1.0 CPU-s/s per idle
  process here. The thread is needed (over TCP the *owner's* UCX worker must progress for a write to
  land), so the plugin creates the native agent itself with ``pthrDelay`` from ``progress_delay`` and
  hands it to the Python wrapper before any backend exists. The thread still wakes at once on UCX
  events; the delay only bounds its sleep.
* **UCX settings** are read from the environment when the backend is created, so ``ucx_tls`` and
  ``ucx_options`` are set there for that moment only (under a lock) and restored.
* **A crash at exit.** With NIXL 1.5.1's wheels, every process that created a UCX backend died with
  SIGSEGV at exit (in the bundled ``libnl-route``'s destructor, ``rtnl_tc_unregister``), once UCX had
  loaded its InfiniBand modules. On a host with no RDMA device those modules serve nothing, so the
  plugin asks UCX not to load them (``UCX_MODULES=^ib``) unless ``UCX_MODULES`` is already set
  (environment or ``ucx_options``). UCX reads it once per process, at the first backend.
* **The GIL.** NIXL loads a backend's plugin (and the UCX it bundles: 0.4 s of library constructors)
  inside a pybind11 call that holds the GIL, so even from the agent's worker thread the event loop
  stood still that long. The plugin file is loaded first through a ctypes ``dlopen``, which releases
  the GIL (:mod:`aioembed.transports.native_libraries`); NIXL's own load then finds it loaded.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aioembed.errors import ConfigError
from aioembed.transports.native_libraries import preload_shared_libraries

from aioembed_nixl._options import NixlOptions

__all__ = ["INSTALL_HINT", "Nixl", "backend_environment", "create_agent", "load_nixl", "rdma_devices"]

INSTALL_HINT = ("pip install 'aioembed-nixl[cu12]' (NIXL built for CUDA 12) or 'aioembed-nixl[cu13]' (CUDA 13); "
                "both run on machines without a GPU")

log = logging.getLogger("aioembed.transports.nixl")

_ENV_LOCK = threading.Lock()
_LOAD_LOCK = threading.Lock()
_LOADED: list[Nixl] = []


@dataclass(frozen=True)
class Nixl:
    """One imported NIXL build."""

    module: str
    """The module it came from (``nixl``, ``nixl_cu12`` or ``nixl_cu13``)."""
    api: Any
    """Its ``_api`` module (``nixl_agent`` and the handle classes)."""
    bindings: Any
    """Its ``_bindings`` module (the native agent and its configuration)."""


def _torch_cuda_major() -> int | None:
    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None)
    try:
        return int(str(version).split(".")[0]) if version else None
    except ValueError:
        return None


def _candidates() -> list[str]:
    major = _torch_cuda_major()
    names = ["nixl"] + ([f"nixl_cu{major}"] if major else []) + ["nixl_cu12", "nixl_cu13"]
    return list(dict.fromkeys(names))


def _quiet_stdout_logging() -> None:
    """Send NIXL's Python log records to the application's logging instead of stdout (at WARNING and
    above, unless ``NIXL_LOG_LEVEL`` asks for more: it logs two INFO lines per agent)."""
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        stream = getattr(handler, "stream", None)
        if stream is sys.stdout or stream is sys.__stdout__:
            nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


def rdma_devices() -> list[str]:
    """RDMA devices of this host (``/sys/class/infiniband``)."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def backend_environment(options: NixlOptions) -> dict[str, str]:
    """The environment the backend is created in: the options' ``UCX_*`` settings, and the exit-crash
    workaround of the module docstring where it applies."""
    env = options.environment()
    if options.backend == "UCX" and "UCX_MODULES" not in env and "UCX_MODULES" not in os.environ \
            and not rdma_devices():
        env["UCX_MODULES"] = "^ib"
    return env


def load_nixl() -> Nixl:
    """Import NIXL once, or raise a ``ConfigError`` that names the pip extra to install."""
    with _LOAD_LOCK:
        if _LOADED:
            return _LOADED[0]
        problems: list[str] = []
        raise_exceptions = logging.raiseExceptions
        try:
            for name in _candidates():
                try:
                    api = importlib.import_module(f"{name}._api")
                    bindings = importlib.import_module(f"{name}._bindings")
                except ModuleNotFoundError as exc:
                    if exc.name in (name, f"{name}._api", f"{name}._bindings"):
                        continue  # not installed
                    problems.append(f"{name}: {exc}")
                    continue
                except Exception as exc:  # a build that is installed but does not load (missing library)
                    problems.append(f"{name}: {type(exc).__name__}: {exc}")
                    continue
                if not hasattr(api, "nixl_agent") or not hasattr(bindings, "nixlAgentConfig"):
                    problems.append(f"{name}: no nixl_agent / nixlAgentConfig (unsupported NIXL version)")
                    continue
                loaded = Nixl(name, api, bindings)
                _LOADED.append(loaded)
                return loaded
        finally:
            logging.raiseExceptions = raise_exceptions
            _quiet_stdout_logging()
        detail = f" ({'; '.join(problems)})" if problems else ""
        raise ConfigError(f"transport 'nixl' needs a NIXL build, and none is importable{detail}; {INSTALL_HINT}")


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the duration (process-wide, so under a lock), then restore."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _plugin_file(backend: str) -> str | None:
    """The file NIXL loads for ``backend``: ``plugins/libplugin_<backend>.so`` beside the ``libnixl.so`` this
    process loaded (NIXL finds its plugins from its own location). ``None`` where that cannot be told."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split(None, 5)[5].strip() for line in maps if line.rstrip().endswith("/libnixl.so")}
    except (OSError, IndexError):
        return None
    if len(libs) != 1:
        return None
    path = os.path.join(os.path.dirname(libs.pop()), "plugins", f"libplugin_{backend}.so")
    return path if os.path.isfile(path) else None


def create_agent(nixl: Nixl, name: str, options: NixlOptions) -> Any:
    """A ``nixl_agent`` named ``name`` with its progress thread sleeping at most ``progress_delay``,
    and the backend of ``options`` created. Blocking (UCX initialises in ~0.4 s): call it off the loop.

    Raises ``ConfigError`` for a backend this build lacks or refuses, with the reason."""
    api, bindings = nixl.api, nixl.bindings
    # The Python wrapper with no backend yet, then its native agent replaced by one configured here.
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                       backends=[]))
    if not hasattr(agent, "agent") or agent.backends:
        raise ConfigError(f"NIXL module {nixl.module!r} has an nixl_agent this plugin does not know how to "
                          "configure (unsupported NIXL version)")
    config = bindings.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = bindings.NIXL_THREAD_SYNC_STRICT
    config.pthrDelay = max(1000, round(options.progress_delay * 1e6))
    config.captureTelemetry = False
    # UCX reads its settings when NIXL first loads the plugin (get_plugin_params already does).
    with _environment(backend_environment(options)):
        if (plugin := _plugin_file(options.backend)) is not None:
            for problem in preload_shared_libraries([plugin]):
                log.debug("nixl: preloading %s (NIXL loads it itself)", problem)
        agent.agent = bindings.nixlAgent(name, config)
        plugins = list(agent.get_plugin_list())
        if options.backend not in plugins:
            raise ConfigError(f"transport_options.backend={options.backend!r}: this NIXL build ({nixl.module}) has "
                              f"no such plugin; it has {sorted(plugins)}")
        known = dict(agent.get_plugin_params(options.backend))
        unknown = sorted(set(options.backend_params) - set(known))
        if unknown:
            raise ConfigError(f"transport_options.backend_params: unknown parameter(s) {unknown} of NIXL backend "
                              f"{options.backend!r}; known: {sorted(known)}")
        try:
            agent.create_backend(options.backend, dict(options.backend_params))
        except Exception as exc:
            settings = {"backend_params": dict(options.backend_params), **(
                {"ucx_tls": options.ucx_tls, "ucx_options": dict(options.ucx_options)}
                if options.backend == "UCX" else {})}
            hint = "" if known else " (NIXL could not load this plugin on this host)"
            raise ConfigError(f"NIXL could not create backend {options.backend!r} with {settings}{hint}: "
                              f"{type(exc).__name__}: {exc}") from exc
    return agent
