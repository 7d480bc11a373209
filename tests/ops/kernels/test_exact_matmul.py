"""The kernels' float32-exact matmul from bfloat16 pieces (copejax.ops.kernels.tiles).

Stick-breaking's, CoPE's and selective attention's TPU kernels (and the GPU kernels' matmul
arms) sum float32 values against 0 / 1 matrices as three bfloat16 matmuls of the values'
pieces. The pieces must be bfloat16 values before any conversion: XLA may skip a float32 ->
bfloat16 -> float32 round trip (``xla_allow_excess_precision``), and jaxlib 0.11.2 did in TPU
interpret mode, where rounding pieces then lost the remainder and the sums kept bfloat16's
precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from copejax.ops.kernels.exact_dots import _bf16_truncated, bf16_pieces, dot_exact_f32


def _values() -> np.ndarray:
    """float32 values over 40 decades, signs, zeros and the largest; no subnormals (XLA's
    CPU, like TPUs and the GPU kernels, flushes them to zero, so their remainders vanish)."""
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, 1.0, -1.0, 1e-30, 3.4e38, -3.4e38, np.pi]
    return np.concatenate([rng.normal(size=500) * 10.0 ** rng.integers(-20, 20, 500), special])


def test_pieces_are_bfloat16_values_that_sum_to_x_exactly() -> None:
    x = jnp.asarray(_values(), jnp.float32)
    for pieces in (bf16_pieces(x), jax.jit(bf16_pieces)(x)):
        assert all(p.dtype == jnp.bfloat16 for p in pieces)
        total = sum(np.asarray(p, np.float64) for p in pieces)
        np.testing.assert_array_equal(total, np.asarray(x, np.float64))
        lo, mid, hi = (np.abs(np.asarray(p, np.float64)) for p in pieces)
        assert np.all(hi >= mid) and np.all(mid >= lo)  # smallest first, as documented


def test_cuts_hold_without_any_rounding_conversion() -> None:
    """Each cut (and the remainder below it) is a bfloat16 value already in float32, so a
    skipped float32 -> bfloat16 -> float32 round trip changes nothing; a cut toward zero of
    a positive value is no larger than it."""
    x = jnp.asarray(_values(), jnp.float32)
    for value in (x, x - _bf16_truncated(x)):
        cut = np.asarray(jax.jit(_bf16_truncated)(value))
        np.testing.assert_array_equal(cut, cut.astype(ml_dtypes.bfloat16).astype(np.float32))
        assert np.all(np.abs(cut) <= np.abs(np.asarray(value)))
    rest = np.asarray(x - _bf16_truncated(x))
    lo = rest - np.asarray(_bf16_truncated(jnp.asarray(rest)))
    np.testing.assert_array_equal(lo, lo.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_dot_exact_f32_equals_float64_triangle_sums() -> None:
    """Row sums over the newer keys of a tile (stick-breaking's within-tile sums) to
    float32's rounding of the float64 sum."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 64)) * np.exp(rng.normal(size=(64, 64)) * 3)
    ones = np.tril(np.ones((64, 64)), -1)
    x32 = jnp.asarray(x, jnp.float32)
    got = np.asarray(jax.jit(dot_exact_f32, static_argnums=(2, 3))(x32, jnp.asarray(ones), (1, 0)))
    expected = np.asarray(x32, np.float64) @ ones
    scale = np.abs(np.asarray(x32, np.float64)) @ ones
    assert np.all(np.abs(got - expected) <= 4 * np.finfo(np.float32).eps * scale + 1e-37)
