"""CoPE's interpolation (arXiv 2405.18719, eq. 8) against a NumPy reference written from the
equation, values and both gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from copejax.ops.interpolate import interpolate_last_axis


def _reference(table_XP: np.ndarray, positions_XS: np.ndarray, cot_XS: np.ndarray) -> tuple:
    """(values, d table, d positions) by loops: z[p] = w z[ceil p] + (1 - w) z[floor p],
    w = p - floor p; d z[floor] += g (1 - w), d z[ceil] += g w, d p = g (z[ceil] - z[floor])."""
    table = table_XP.reshape(-1, table_XP.shape[-1]).astype(np.float64)
    positions = positions_XS.reshape(table.shape[0], -1).astype(np.float64)
    cot = cot_XS.reshape(positions.shape).astype(np.float64)
    values, d_table, d_pos = (
        np.zeros_like(positions),
        np.zeros_like(table),
        np.zeros_like(positions),
    )
    for r in range(table.shape[0]):
        for s in range(positions.shape[1]):
            p = positions[r, s]
            lo, hi = int(np.floor(p)), int(np.ceil(p))
            w = p - lo
            values[r, s] = w * table[r, hi] + (1 - w) * table[r, lo]
            d_table[r, lo] += cot[r, s] * (1 - w)
            d_table[r, hi] += cot[r, s] * w
            d_pos[r, s] = cot[r, s] * (table[r, hi] - table[r, lo])
    return (
        values.reshape(positions_XS.shape),
        d_table.reshape(table_XP.shape),
        d_pos.reshape(positions_XS.shape),
    )


def test_values_and_gradients_match_the_equation() -> None:
    rng = np.random.default_rng(0)
    table = rng.normal(size=(2, 3, 5, 8)).astype(np.float32)
    positions = rng.uniform(0, 7, size=(2, 3, 5, 6)).astype(np.float32)
    positions[0, 0, 0, :3] = [0.0, 3.0, 7.0]  # integer positions: floor == ceil
    cot = rng.normal(size=positions.shape).astype(np.float32)
    values, vjp = jax.vjp(interpolate_last_axis, jnp.asarray(table), jnp.asarray(positions))
    d_table, d_pos = vjp(jnp.asarray(cot))
    ref_values, ref_d_table, ref_d_pos = _reference(table, positions, cot)
    np.testing.assert_allclose(values, ref_values, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_table, ref_d_table, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_pos, ref_d_pos, rtol=1e-5, atol=1e-5)


def test_a_table_row_broadcasts_over_positions() -> None:
    """A table with leading size 1 is read by every row of positions (take_along_axis's
    broadcasting), under jit as eagerly."""
    rng = np.random.default_rng(1)
    table = rng.normal(size=(1, 4, 8)).astype(np.float32)
    positions = rng.uniform(0, 7, size=(3, 4, 5)).astype(np.float32)
    expected = _reference(np.broadcast_to(table, (3, 4, 8)), positions, positions)[0]
    eager = interpolate_last_axis(jnp.asarray(table), jnp.asarray(positions))
    jitted = jax.jit(interpolate_last_axis)(jnp.asarray(table), jnp.asarray(positions))
    np.testing.assert_allclose(eager, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)  # XLA may fuse into FMAs


def test_positions_broadcast_over_table_rows_and_outside_positions_are_clipped() -> None:
    """Positions with leading size 1 are read in every table row; positions below 0 or above
    P - 1 read the first or last value, with no gradient to the position."""
    rng = np.random.default_rng(2)
    table = rng.normal(size=(3, 4, 8)).astype(np.float32)
    positions = rng.uniform(-2, 9, size=(1, 4, 5)).astype(np.float32)
    cot = rng.normal(size=(3, 4, 5)).astype(np.float32)
    values, vjp = jax.vjp(interpolate_last_axis, jnp.asarray(table), jnp.asarray(positions))
    d_table, d_pos = vjp(jnp.asarray(cot))
    clipped = np.broadcast_to(np.clip(positions, 0, 7), (3, 4, 5))
    ref_values, ref_d_table, ref_d_pos = _reference(table, clipped, cot)
    np.testing.assert_allclose(values, ref_values, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_table, ref_d_table, rtol=1e-5, atol=1e-5)
    inside = (positions >= 0) & (positions <= 7)
    expected_d_pos = np.where(inside, ref_d_pos.sum(axis=0, keepdims=True), 0.0)
    np.testing.assert_allclose(d_pos, expected_d_pos, rtol=1e-5, atol=1e-5)
