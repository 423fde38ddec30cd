"""The benchmark's targets, checked against what a run measured. Plain data: no presentation here."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["evaluate_targets", "number"]


def number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _target(name: str, threshold: str, measured: float | None, met: bool | None, note: str) -> dict[str, Any]:
    return {"target": name, "threshold": threshold, "measured": measured, "met": met, "note": note}


def evaluate_targets(workloads: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The targets of the workloads that ran (``met`` is None where a number is missing): the speed goals
    (W1, W2, W3; see :mod:`aioembed.bench.goals`), idle CPU and peak memory."""
    out: list[dict[str, Any]] = list(workloads.get("goals", {}).get("goals", []))
    if "idle" in workloads:
        idle = workloads["idle"]
        v = number(idle.get("cpu_s_per_s"))
        out.append(_target(f"idle: CPU s/s with {idle.get('rooms', 1000)} pending rooms", "<= 0.01", v,
                           None if v is None else v <= 0.01,
                           "whole process (sender + receiver, all threads): an upper bound on the receiver's share"))
    if "memory" in workloads:
        mem = workloads["memory"]
        v = number(mem.get("ratio"))
        out.append(_target(f"memory: receiver peak RSS / (pool + output), {mem.get('tokens', 50000)} tokens",
                           "<= 1.10", v, None if v is None else v <= 1.10,
                           "child process; source subtracted; sender overhead counted"))
    return out
