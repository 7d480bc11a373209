"""FIRE's kernel tile and its hand-written parameter pull-back (copejax.model.kernel_fire),
against NumPy: FIRE's bias ``f(psi(|i - j|) / psi(max(i, L)))`` (Li et al. 2023, arXiv
2310.04418) and central differences of it in float64, in the GPU's and the TPU's tile
layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.kernel_fire import FireTile
from copejax.ops.kernels.terms import TermTile, pulled_by_hand

WIDTH, EPS = 5, 1e-6


def numpy_bias(row: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """b2 + sum_u w2[u] relu(x w1[u] + b1[u]), x = log(1 + c |i - j|) / (log(1 + c max(i, L))
    + eps), float64 (Q, K)."""
    c, threshold, b2 = row[:3]
    w1, b1, w2 = row[3 : 3 + WIDTH], row[3 + WIDTH : 3 + 2 * WIDTH], row[3 + 2 * WIDTH :]
    distance = np.abs(q[:, None] - k[None, :])
    x = np.log1p(c * distance) / (np.log1p(c * np.maximum(q, threshold))[:, None] + EPS)
    hidden = np.maximum(x[..., None] * w1 + b1, 0.0)
    return b2 + hidden @ w2


def a_row(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    units = rng.normal(size=3 * WIDTH)  # mixed signs: some units off on some pairs
    return np.concatenate([[0.3, 6.0, 0.5], units])


def tile_of(q: np.ndarray, k: np.ndarray, layout: str) -> TermTile:
    q_pos, k_pos = jnp.asarray(q, jnp.int32), jnp.asarray(k, jnp.int32)
    if layout == "tpu":  # (Q, 1) and (1, K)
        q_pos, k_pos = q_pos[:, None], k_pos[None, :]
    return TermTile(q_pos, k_pos, None, None)


def row_of(row: np.ndarray, layout: str) -> jax.Array:
    row_P = jnp.asarray(row, jnp.float32)
    return row_P[None, :] if layout == "tpu" else row_P


@pytest.mark.parametrize("layout", ["gpu", "tpu"])
def test_tile_equals_the_paper_bias(layout: str) -> None:
    q, k = np.arange(8, 16), np.arange(0, 16, 2)
    row = a_row(0)
    got = FireTile(WIDTH)(row_of(row, layout), tile_of(q, k, layout))
    np.testing.assert_allclose(got, numpy_bias(row, q, k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["gpu", "tpu"])
@pytest.mark.parametrize("seed", [1, 2])
def test_pull_params_equals_central_differences(layout: str, seed: int) -> None:
    q, k = np.arange(3, 11), np.arange(0, 8)
    row = a_row(seed)
    g = np.random.default_rng(seed + 10).normal(size=(q.size, k.size))
    tile_fn = FireTile(WIDTH)
    assert pulled_by_hand(tile_fn)
    got = tile_fn.pull_params(row_of(row, layout), tile_of(q, k, layout), jnp.asarray(g))
    assert got.shape == row_of(row, layout).shape
    want = np.zeros_like(row)
    for entry in range(row.size):
        step = 1e-6 * max(1.0, abs(row[entry]))
        up, down = row.copy(), row.copy()
        up[entry] += step
        down[entry] -= step
        want[entry] = np.sum(g * (numpy_bias(up, q, k) - numpy_bias(down, q, k))) / (2 * step)
    np.testing.assert_allclose(np.ravel(got), want, rtol=2e-4, atol=2e-4)


def test_pull_back_and_custom_vjp_equal_autodiff_of_the_loop() -> None:
    """The hand pull-back, and ``jax.vjp`` of the tile in the TPU's layout (its custom VJP),
    equal autodiff of the plain loop over units (``FireTile.value``, the tile in the GPU's
    layout), relu's kink included: with w1 = 1 and b1 = 0 the diagonal's pairs (x = 0) sit
    on it."""
    q, k = np.arange(0, 8), np.arange(0, 8)
    row = np.concatenate([[0.3, 6.0, 0.5], np.ones(WIDTH), np.zeros(WIDTH), np.ones(WIDTH)])
    g = jnp.asarray(np.random.default_rng(3).normal(size=(8, 8)), jnp.float32)
    tile_fn, tile = FireTile(WIDTH), tile_of(q, k, "gpu")
    row_P = jnp.asarray(row, jnp.float32)
    (want,) = jax.vjp(lambda r: tile_fn.value(r, tile), row_P)[1](g)
    np.testing.assert_allclose(tile_fn.pull_params(row_P, tile, g), want, rtol=1e-5, atol=1e-5)
    # the TPU layout's custom VJP
    tpu_tile, tpu_row = tile_of(q, k, "tpu"), row_P[None, :]
    (custom,) = jax.vjp(lambda r: tile_fn(r, tpu_tile), tpu_row)[1](g)
    np.testing.assert_allclose(custom[0], want, rtol=1e-5, atol=1e-5)
