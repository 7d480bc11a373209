"""Tolerances for comparing two float32 computations of the same quantity.

Two summation orders of n float32 terms differ by at most about ``n * eps32`` times the sum of
the terms' magnitudes (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
section 4.2: |fl(sum) - sum| <= (n - 1) u sum |x_i|, u = eps / 2). XLA's CPU runtime splits
reductions by thread count and load, so a test that compares two orders of the same gradient
at a fixed ``atol=1e-6`` fails some runs. These helpers derive the tolerance from float32's
epsilon and the size of the reduction instead, so it scales with the computation and not with
what happened to pass.
"""

from __future__ import annotations

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


def float32_sum_atol(scale: float, summands: int) -> float:
    """The absolute tolerance for two orders of a float32 sum of ``summands`` terms whose
    magnitudes add up to at most ``scale`` (the worst-case bound, n eps sum |x_i|)."""
    if summands < 1:
        raise ValueError(f"summands must be >= 1, got {summands}")
    return summands * EPS32 * scale


def assert_same_float32_sum(actual: object, desired: object, *, summands: int) -> None:
    """``actual`` and ``desired`` agree up to the reordering of float32 sums of ``summands``
    terms. The scale of the terms is taken from the result: ``max |desired|`` (at least 1e-30
    so that all-zero arrays compare exactly)."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    scale = max(float(np.max(np.abs(desired), initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, desired, rtol=0, atol=float32_sum_atol(scale, summands))
