"""The bench's variant order: a Williams design balances positions and neighbours over each cycle."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from aioembed.bench.run_order import balanced_orders, cycle_length


@pytest.mark.parametrize("k", range(1, 10))
def test_each_cycle_balances_positions_and_neighbours(k: int) -> None:
    variants = [f"v{i}" for i in range(k)]
    cycle = cycle_length(k)
    rows = balanced_orders(variants, 3 * cycle)
    assert all(sorted(row) == sorted(variants) for row in rows)  # every row runs each variant once
    assert rows[:cycle] == rows[cycle:2 * cycle] == rows[2 * cycle:]  # deterministic, cycling
    one = rows[:cycle]
    per_square = cycle // k
    positions = Counter((row.index(v), v) for row in one for v in row)
    assert set(positions.values()) == {per_square} and len(positions) == k * k
    after = Counter((row[i], row[i + 1]) for row in one for i in range(k - 1))
    # Every variant directly follows every other one, equally often: the carry-over of one never lands on one other.
    assert len(after) == k * (k - 1)
    assert set(after.values()) <= {per_square}


@pytest.mark.parametrize("k", range(3, 12))
def test_no_variant_runs_twice_in_a_row_across_repetitions(k: int) -> None:
    """A repetition starts right after the one before it: a row that began with the variant the previous row
    ended with would run it twice in a row (three variants did, before the rows were chained)."""
    rows = balanced_orders([f"v{i}" for i in range(k)], 2 * cycle_length(k) + 1)
    runs = [v for row in rows for v in row]
    assert all(a != b for a, b in itertools.pairwise(runs))


def test_the_cycle_is_k_rows_for_an_even_count_and_2k_for_an_odd_one() -> None:
    assert [cycle_length(k) for k in range(1, 8)] == [1, 2, 6, 4, 10, 6, 14]


def test_unlike_a_rotation_no_variant_always_follows_the_same_one() -> None:
    """The order it replaces (``A B C D``, ``B C D A``, ...) put B after A in three rows of four."""
    rows = balanced_orders(["A", "B", "C", "D"], 4)
    before_b = Counter(row[row.index("B") - 1] for row in rows if row.index("B") > 0)
    assert max(before_b.values()) == 1


def test_no_variants_and_no_repetitions() -> None:
    assert balanced_orders([], 3) == [[], [], []]
    assert balanced_orders(["a", "b"], 0) == []
