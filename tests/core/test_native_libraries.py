"""Preloading shared libraries for transport plugins (``aioembed.transports.native_libraries``)."""

from __future__ import annotations

import ctypes.util
import os

from aioembed.transports.native_libraries import preload_shared_libraries


def test_a_library_that_exists_loads_and_one_that_does_not_is_named(tmp_path: os.PathLike[str]) -> None:
    libm = ctypes.util.find_library("m")
    assert libm is not None
    missing = os.path.join(os.fspath(tmp_path), "libnothing.so")
    not_a_library = os.path.join(os.fspath(tmp_path), "libtext.so")
    with open(not_a_library, "w") as f:
        f.write("not an ELF file")
    problems = preload_shared_libraries([libm, missing, not_a_library])
    assert len(problems) == 2, problems
    assert problems[0].startswith(missing + ": ") and "No such file" in problems[0], problems
    assert problems[1].startswith(not_a_library + ": "), problems
    assert preload_shared_libraries([libm]) == []  # loaded once; a second call does nothing
