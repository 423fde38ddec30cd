"""Statistics helpers for the benchmark: order statistics, spreads, throughputs, ratios.

Pure functions on plain floats (no numpy) so the numbers in the JSON are reproducible from
the raw samples it also contains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ["Summary", "mbps", "quantile", "ratio", "summarize"]


def quantile(samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0 <= q <= 1) with linear interpolation between order statistics.

    This is the "type 7" estimator (numpy's default ``linear`` method): ``q=0.5`` is the
    median, ``q=0`` the minimum and ``q=1`` the maximum.
    """
    if not samples:
        raise ValueError("quantile of an empty sample")
    if not 0.0 <= q <= 1.0 or math.isnan(q):
        raise ValueError(f"quantile q={q} must be in [0, 1]")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


@dataclass(frozen=True, slots=True)
class Summary:
    """Order statistics of one series of samples (seconds, or any other unit)."""

    n: int
    min: float
    q1: float
    median: float
    q3: float
    p99: float
    max: float
    mean: float

    @property
    def iqr(self) -> float:
        """Interquartile range ``q3 - q1``."""
        return self.q3 - self.q1

    def to_dict(self) -> dict[str, float]:
        """Plain dict for JSON (``n`` included)."""
        return asdict(self)


def summarize(samples: Sequence[float]) -> Summary:
    """Summary of a non-empty series."""
    if not samples:
        raise ValueError("cannot summarize an empty sample")
    return Summary(
        n=len(samples),
        min=min(samples),
        q1=quantile(samples, 0.25),
        median=quantile(samples, 0.5),
        q3=quantile(samples, 0.75),
        p99=quantile(samples, 0.99),
        max=max(samples),
        mean=math.fsum(samples) / len(samples),
    )


def mbps(nbytes: float, seconds: float) -> float:
    """Throughput in MB/s (10**6 bytes per second); ``inf`` for a zero duration."""
    if seconds < 0 or nbytes < 0:
        raise ValueError(f"negative bytes or seconds: {nbytes}, {seconds}")
    return math.inf if seconds == 0 else nbytes / seconds / 1e6


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
