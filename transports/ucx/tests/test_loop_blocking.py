"""The first endpoint of a process loads the engine's native libraries without holding the event loop: UCX's native
libraries (libucs, libuct, libucp: 0.4 s of constructors on this host) load with the GIL released (before, the
loop stood still for the whole load: 0.45 s of a 0.47 s open on an idle host, 2-3 s on a loaded one)."""

from __future__ import annotations

from aioembed.testing.loop import check_first_open_leaves_the_loop_running

from .conftest import UCX_OPTIONS


def test_the_first_open_in_a_process_leaves_the_loop_running() -> None:
    check_first_open_leaves_the_loop_running("ucx", UCX_OPTIONS)
