"""The first endpoint of a process loads the engine's native libraries without holding the event loop: NIXL's UCX
backend plugin and the UCX it bundles (0.4 s of constructors on this host) load with the GIL released (before,
the loop stood still for most of the open: 0.40 s of a 0.53-0.59 s open on an idle host)."""

from __future__ import annotations

from aioembed.testing.loop import check_first_open_leaves_the_loop_running

from .conftest import NIXL_TCP_OPTIONS


def test_the_first_open_in_a_process_leaves_the_loop_running() -> None:
    check_first_open_leaves_the_loop_running("nixl", NIXL_TCP_OPTIONS)
