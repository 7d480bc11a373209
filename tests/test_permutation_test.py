"""The exact permutation test against hand counts and an enumeration of every ordering."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from experiments.permutation_test import MAX_SPLITS, permutation_p


def test_hand_counted_values() -> None:
    # Of the C(6, 3) = 20 splits of 1..6, only {1, 2, 3} | {4, 5, 6} and its mirror reach the
    # observed |2 - 5| = 3: p = 2 / 20.
    assert permutation_p([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == pytest.approx(0.1)
    assert permutation_p([4.0, 5.0, 6.0], [1.0, 2.0, 3.0]) == pytest.approx(0.1)
    # Equal sets: every split is at least as far apart as the observed 0.
    assert permutation_p([0.5, 0.6], [0.6, 0.5]) == 1.0
    # Five seeds a side that do not overlap reach the smallest p, 2 / 252.
    assert permutation_p([0.1] * 5, [0.2] * 5) == pytest.approx(2 / 252)
    assert np.isnan(permutation_p([], [0.1]))


def test_matches_every_ordering_of_the_pool() -> None:
    """Each split appears len(a)! len(b)! times among the orderings of the pooled values, so
    the fraction of orderings whose first len(a) values are as far apart gives the same p."""
    rng = np.random.default_rng(0)
    a, b = list(rng.normal(0.6, 0.02, 3)), list(rng.normal(0.62, 0.03, 4))
    observed = abs(np.mean(a) - np.mean(b))
    pool = a + b
    hits = total = 0
    for order in itertools.permutations(pool):
        first, second = order[: len(a)], order[len(a) :]
        hits += abs(np.mean(first) - np.mean(second)) >= observed - 1e-12
        total += 1
    assert permutation_p(a, b) == pytest.approx(hits / total)


def test_refuses_more_splits_than_it_counts() -> None:
    with pytest.raises(ValueError, match="splits, more than MAX_SPLITS"):
        permutation_p([0.0] * 13, [1.0] * 13)  # C(26, 13) = 10,400,600
    assert MAX_SPLITS >= 184_756  # ten seeds a side stay exact
