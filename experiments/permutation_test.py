"""An exact two-sample permutation test of a difference in means: how often splitting the
pooled per-seed scores of two arms at random gives a mean difference at least as large as the
one observed. It assumes no distribution, which suits five seeds a side (every one of the
C(10, 5) = 252 splits is counted, so the smallest two-sided p is 2 / 252 ≈ 0.008)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

MAX_SPLITS = 1_000_000  # C(20, 10) = 184,756: ten seeds a side are still exact


def permutation_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p of ``mean(a) != mean(b)``: the fraction of the splits of ``a + b`` into
    groups of ``len(a)`` and ``len(b)`` whose absolute mean difference is at least the observed
    one (the observed split included, so p > 0). NaN when either side is empty; an error when
    the splits are more than ``MAX_SPLITS`` (too many to count exactly)."""
    if not a or not b:
        return float("nan")
    pooled = np.asarray([*a, *b], dtype=np.float64)
    n, splits = len(a), math.comb(len(pooled), len(a))
    if splits > MAX_SPLITS:
        raise ValueError(
            f"{len(a)} + {len(b)} values have {splits} splits, more than MAX_SPLITS = "
            f"{MAX_SPLITS} to count exactly"
        )
    total = pooled.sum()
    observed = abs(pooled[:n].mean() - pooled[n:].mean())
    as_large = 0
    for chosen in itertools.combinations(range(len(pooled)), n):
        first = pooled[list(chosen)].sum()
        difference = abs(first / n - (total - first) / len(b))
        as_large += difference >= observed - 1e-12 * max(1.0, observed)
    return as_large / splits
