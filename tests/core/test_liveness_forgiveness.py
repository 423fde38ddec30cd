"""A stall of our own loop forgives a peer's silence, but not for ever: sans-IO tests of :class:`PeerClock`.

The heartbeat task forgives every peer after a late wake-up (silence we could not hear is not the peer's
fault). A loop late on *every* wake-up (a CPU-bound handler on a saturated server) forgave a dead peer at each
one, so it was never declared silent, its rooms never ended by that, and its session never replaced.
"""

from __future__ import annotations

from aioembed.session.liveness import PeerClock

INTERVAL = 1.0
LIMIT = 5 * INTERVAL  # heartbeat_misses = 5


def test_a_dead_peer_is_found_silent_though_the_loop_is_late_on_every_wake_up() -> None:
    clock = PeerClock(0.0)  # heard last at 0, then it died
    now = 0.0
    for _ in range(20):
        now += INTERVAL + 1.5  # the heartbeat task slept an interval and woke 1.5 s late, every time
        clock.forgive(now, INTERVAL)
        if clock.silent(now, LIMIT):
            break
    else:
        raise AssertionError(f"a peer silent since 0 s was still not silent at {now:.1f} s: a loop late on every "
                             f"wake-up forgave it each time")
    assert now <= LIMIT + 3 * (INTERVAL + 1.5)  # within a silence window of the first forgiveness (and a wake-up)


def test_a_single_long_stall_is_forgiven_and_a_live_peer_stays_alive_through_many() -> None:
    clock = PeerClock(0.0)
    clock.forgive(60.0, INTERVAL)  # a 60 s GC pause: its frames wait in the socket
    assert not clock.silent(60.0, LIMIT) and not clock.silent(60.0 + LIMIT - INTERVAL, LIMIT)
    now = 60.0
    for _ in range(20):  # a live peer under the same saturation: heard between the late wake-ups
        clock.heard(now + 0.5)
        now += INTERVAL + 1.5
        clock.forgive(now, INTERVAL)
        assert not clock.silent(now, LIMIT)
    clock.heard(now)
    clock.forgive(now + 30.0, INTERVAL)  # another long pause after it was heard: forgiven again
    assert not clock.silent(now + 30.0, LIMIT)
