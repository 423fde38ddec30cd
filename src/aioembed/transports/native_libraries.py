"""Loading a native engine's shared libraries without holding the GIL, for transport plugins.

CPython keeps the GIL through ``ctypes.CDLL(path)`` and through an extension's own ``dlopen`` (a
pybind11 call that loads an engine plugin), so a library whose constructors take 0.4 s (UCX's do)
stalls the event loop that long even when it is loaded from a worker thread. A ``dlopen`` called
through a ctypes foreign function releases the GIL; once a file is loaded, the engine's own later
``dlopen`` of the same file only counts a reference, which is quick.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["preload_shared_libraries"]

_handles: dict[str, int] = {}
"""Path -> handle, never closed: the engine's own ``dlopen`` of the same files shares these."""


def _dlopen() -> tuple[Any, Any]:
    libc = ctypes.CDLL(None)  # the process's global symbols: glibc's dlopen (in libc since 2.34, libdl before)
    dlopen, dlerror = libc.dlopen, libc.dlerror
    dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    dlerror.restype, dlerror.argtypes = ctypes.c_char_p, []
    return dlopen, dlerror


def preload_shared_libraries(paths: Sequence[str]) -> list[str]:
    """Load each file of ``paths`` (``RTLD_NOW | RTLD_LOCAL``, in order) with the GIL released; call from a
    worker thread, before the engine loads them. Returns what failed, one line per file (for a log line:
    the engine then loads them itself, holding the GIL, which is slower but works)."""
    try:
        dlopen, dlerror = _dlopen()
    except (OSError, AttributeError) as exc:
        return [f"no dlopen reachable through ctypes: {exc}"]
    problems = []
    for path in paths:
        if path in _handles:
            continue
        handle = dlopen(os.fsencode(path), os.RTLD_NOW | os.RTLD_LOCAL)
        if handle:
            _handles[path] = handle
        else:
            why = dlerror()
            problems.append(f"{path}: {why.decode(errors='replace') if why else 'dlopen failed'}")
    return problems
