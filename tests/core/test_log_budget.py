"""``WarningBudget``: one WARNING per kind and window, the rest at DEBUG, counted in the next WARNING."""

from __future__ import annotations

import logging

import pytest

from aioembed.log_budget import WarningBudget


def test_a_flood_of_one_kind_logs_one_warning_per_window_and_loses_nothing(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = logging.getLogger("test.log_budget")
    budget = WarningBudget(log, window=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="test.log_budget"):
        for i in range(1000):
            budget.warn("bad", "bad frame %d", i)
            now[0] += 0.001
        budget.warn("other", "another kind")  # its own budget
        now[0] = 20.0
        budget.warn("bad", "bad frame %d", 1000)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert warnings == ["bad frame 0", "another kind",
                        "bad frame 1000 (and 999 more like it since the last such warning, logged at DEBUG)"]
    assert debug == [f"bad frame {i}" for i in range(1, 1000)]  # every one, in full
