"""Tolerances for the fused kernels' tests, derived from the dtype and the reduction size.

- Two float32 evaluations of a sum of n terms differ by at most n eps32 sum |x_i|
  (`tests.float_tolerance.float32_sum_atol`;
  Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 4.2); the
  reference's largest magnitude stands for sum |x_i| (a softmax average of values is at most
  their largest magnitude).
- A bfloat16 path rounds a handful of operands to bfloat16 (unit roundoff u = eps / 2) on
  each side: the softmax weights before the value matmul and the output (forward); dS, P and
  the cotangent before the gradient matmuls and the gradient itself (backward). Each rounding
  moves a result by at most u times the sum of its terms' magnitudes, so ``roundings`` of
  them on each of two paths stay within ``roundings * eps * scale``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tests.float_tolerance import float32_sum_atol

EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)


def bfloat16_atol(scale: float, roundings: int) -> float:
    """``roundings`` bfloat16 roundings on each of two paths, at most eps each."""
    return roundings * EPS_BF16 * scale


def assert_close(
    actual,
    desired,
    *,
    dtype: str,
    summands: int,
    roundings: int,
    scale: float | None = None,
    err_msg: str = "",
) -> None:
    """``actual`` equals ``desired`` within the float32 reordering bound, plus the bfloat16
    rounding bound for a bfloat16 computation, both scaled by ``scale`` (default
    ``max |desired|``, the magnitude of the terms where nothing cancels)."""
    actual = np.asarray(np.asarray(actual, np.float32), np.float64)
    desired = np.asarray(np.asarray(desired, np.float32), np.float64)
    if scale is None:
        scale = float(np.max(np.abs(desired), initial=0.0))
    scale = max(scale, 1e-30)
    atol = float32_sum_atol(scale, summands)
    if dtype == "bfloat16":
        atol += bfloat16_atol(scale, roundings)
    np.testing.assert_allclose(actual, desired, rtol=0, atol=atol, err_msg=err_msg)
