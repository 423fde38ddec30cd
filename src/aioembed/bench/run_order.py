"""The order in which a point's variants run, repetition after repetition.

A variant can leave the machine in a state that slows the next one: a copying ``receive()`` into a fresh
471 MB output leaves page faults and memory traffic behind, a thread pool its spinning workers. With the order
merely rotated each repetition (``A B C D``, ``B C D A``, ...), every variant but the first of a row follows the
same one every time, so that carry-over lands on one variant only (NIXL over TCP, 65536 tokens: the zero-copy
room that always followed the copying one measured 0.90 of raw, 0.92-0.95 without it; see the NIXL plugin's
performance history). A Williams design is a Latin square whose rows also balance the neighbours: over one cycle
each variant runs once in each position and directly after every other variant equally often (once per cycle
for an even number of variants, twice for an odd one, whose cycle is twice as long).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_orders", "cycle_length"]


def cycle_length(k: int) -> int:
    """Rows in one balanced cycle of ``k`` variants: ``k`` if ``k`` is even (or 1), else ``2k``."""
    return k if k % 2 == 0 or k == 1 else 2 * k


def _williams_rows(k: int) -> list[list[int]]:
    # 0, 1, k-1, 2, k-2, ...: its steps (mod k) are 1, -2, 3, -4, ..., each nonzero residue once when k is even,
    # so the rows made by adding r to every entry have each ordered pair of neighbours once.
    base = [0 if i == 0 else (i + 1) // 2 if i % 2 == 1 else k - i // 2 for i in range(k)]
    rows = [[(b + r) % k for b in base] for r in range(k)]
    if k % 2 == 1 and k > 1:  # odd: the mirrored square supplies the pairs the first one repeats
        rows += [row[::-1] for row in rows]
    return rows


def balanced_orders(variants: Sequence[str], reps: int) -> list[list[str]]:
    """``reps`` orders of ``variants``, cycling through a Williams design (see the module doc): over each full
    cycle (:func:`cycle_length` rows) every variant runs once per position per square and directly after every
    other variant equally often. Deterministic, so a run can be repeated."""
    k = len(variants)
    if k == 0:
        return [[] for _ in range(reps)]
    rows = _williams_rows(k)
    return [[variants[i] for i in rows[r % len(rows)]] for r in range(reps)]
