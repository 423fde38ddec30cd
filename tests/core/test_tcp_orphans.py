"""The bound on what a closed TCP socket may still deliver (transports/tcp_orphans.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aioembed.transports import tcp_orphans
from aioembed.transports.tcp_orphans import orphan_retransmit_horizon


def test_linux_default_is_eight_retries_from_the_200_ms_floor() -> None:
    assert orphan_retransmit_horizon(0) == pytest.approx(0.2 * (2**9 - 1))  # 102.2 s
    assert orphan_retransmit_horizon(8) == orphan_retransmit_horizon(0)
    assert orphan_retransmit_horizon(1) == pytest.approx(0.6)


def test_each_wait_is_capped_at_the_largest_retransmission_timeout() -> None:
    # 0.2 * 2**10 > 120: from the 11th wait on, 120 s each.
    assert orphan_retransmit_horizon(15) == pytest.approx(0.2 * (2**10 - 1) + 6 * 120.0)


def test_this_hosts_setting_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "tcp_orphan_retries"
    setting.write_text("3\n")
    monkeypatch.setattr(tcp_orphans, "_ORPHAN_RETRIES", setting)
    assert orphan_retransmit_horizon() == pytest.approx(0.2 * (2**4 - 1))
    monkeypatch.setattr(tcp_orphans, "_ORPHAN_RETRIES", setting.parent / "missing")
    assert orphan_retransmit_horizon() == pytest.approx(102.2)  # not Linux: its default assumed
