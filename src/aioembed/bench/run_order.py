"""The order in which a point's variants run, repetition after repetition.

A variant can leave the machine in a state that slows the next one: a copying ``receive()`` into a fresh
471 MB output leaves page faults and memory traffic behind, a thread pool its spinning workers. With the order
merely rotated each repetition (``A B C D``, ``B C D A``, ...), every variant but the first of a row follows the
same one every time, so that carry-over lands on one variant only (NIXL over TCP, 65536 tokens: the zero-copy
room measured 0.90 of raw with the copying room in the sequence, 0.92-0.95 with it left out; see the NIXL plugin's
performance history). A Williams design is a Latin square whose rows also balance the neighbours: within the
rows of one cycle, each variant runs once in each position per square and directly after every other variant
equally often (once per cycle for an even number of variants, twice for an odd one, whose cycle has two
squares). The rows are chained so that no repetition starts with the variant the previous one ended with (for
three or more variants). What the rows cannot balance: the pair across each row boundary, and a number of timed
repetitions that is not a multiple of the cycle; even then no variant follows the same one every time.
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
    if cycle_length(k) > k:  # odd: the mirrored square supplies the pairs the first one repeats
        rows += [row[::-1] for row in rows]
    return _chained(rows)


def _chained(rows: list[list[int]]) -> list[list[int]]:
    """``rows`` reordered (the first kept first) so that no row starts with the index the one before it ends with,
    the last row included (the cycle repeats); ``rows`` as they are if no such order exists (two variants)."""
    n = len(rows)
    order, used = [0], [True] + [False] * (n - 1)

    def extend() -> bool:
        if len(order) == n:
            return rows[order[-1]][-1] != rows[0][0]
        end = rows[order[-1]][-1]
        for i in range(1, n):
            if not used[i] and rows[i][0] != end:
                used[i] = True
                order.append(i)
                if extend():
                    return True
                order.pop()
                used[i] = False
        return False

    return [rows[i] for i in order] if extend() else rows


def balanced_orders(variants: Sequence[str], reps: int) -> list[list[str]]:
    """``reps`` orders of ``variants``, cycling through a Williams design (see the module doc): within the rows of
    each full cycle (:func:`cycle_length` rows) every variant runs once per position per square and directly after
    every other variant equally often. Deterministic, so a run can be repeated."""
    k = len(variants)
    if k == 0:
        return [[] for _ in range(reps)]
    rows = _williams_rows(k)
    return [[variants[i] for i in rows[r % len(rows)]] for r in range(reps)]
