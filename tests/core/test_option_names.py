"""An unknown ``transport_options`` key is refused naming the known key it is closest to, in every transport."""

from __future__ import annotations

import pytest

from aioembed import ConfigError
from aioembed.transports.loopback import LoopbackTransport
from aioembed.transports.option_names import refuse_unknown_options

KNOWN = ("tls", "host", "port", "progress_mode", "write_timeout")


def test_known_names_pass() -> None:
    refuse_unknown_options("ucx", {"tls": "tcp", "port": 1}, KNOWN)
    refuse_unknown_options("ucx", {}, KNOWN)


def test_one_misspelt_name_is_pointed_at_the_known_one() -> None:
    with pytest.raises(ConfigError) as info:
        refuse_unknown_options("ucx", {"tsl": "tcp"}, KNOWN)
    assert str(info.value) == ("unknown ucx transport option(s) ['tsl'] (did you mean 'tls'?); known: "
                               "['host', 'port', 'progress_mode', 'tls', 'write_timeout']")


def test_several_names_each_get_their_own_hint_and_a_name_near_nothing_gets_none() -> None:
    with pytest.raises(ConfigError) as info:
        refuse_unknown_options("ucx", {"progres_mode": 1, "write_timout": 2, "zzz": 3}, KNOWN)
    msg = str(info.value)
    assert msg.startswith("unknown ucx transport option(s) ['progres_mode', 'write_timout', 'zzz'] (did you mean "
                          "'progress_mode' for 'progres_mode', 'write_timeout' for 'write_timout'?); known: ")
    with pytest.raises(ConfigError) as info:
        refuse_unknown_options("ucx", {"zzz": 3}, KNOWN)
    assert "did you mean" not in str(info.value)


def test_a_case_or_space_slip_is_pointed_at_too() -> None:
    with pytest.raises(ConfigError, match=r"\['TLS '\] \(did you mean 'tls'\?\)"):
        refuse_unknown_options("ucx", {"TLS ": "tcp"}, KNOWN)


def test_the_loopback_transport_says_it() -> None:
    with pytest.raises(ConfigError, match=r"\['threds'\] \(did you mean 'threads'\?\)"):
        LoopbackTransport.check_options({"threds": 2})
