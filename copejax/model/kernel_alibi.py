"""ALiBi's kernel term (Press et al. 2022, arXiv 2108.12409): ``-m_h (i - j)`` as a
separable term of the fused kernels (issue 45, :mod:`copejax.ops.kernels.separable`).

Shape letters: Q / K the tile's queries / keys, X either, P the head's parameters (its slope).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops.kernels.terms import TermTile, batch_rows, param_scalars, tile_shape
from copejax.positions.alibi import alibi_bias


class AlibiTile:
    """ALiBi's ``-m_h (i - j)`` as the row ``-m_h (i - o)`` and the column ``m_h (j - o)``
    (:mod:`copejax.ops.kernels.separable`), ``o`` the smallest position of one side of the
    tile: integer differences, so each side rounds at the tile's distances.

    The slopes are the paper's constants, not parameters: stopping their gradient drops the
    dk / dv kernel's per-tile sum for a slope gradient nobody reads (with it, that kernel
    spilled 236 bytes per thread on an H100; ``experiments/results/kernel_ptx.md``)."""

    def origin(self, params_P: jax.Array, positions_X: jax.Array, values_X: None) -> jax.Array:
        return jnp.min(positions_X.astype(jnp.float32))  # Mosaic reduces floats

    def row(
        self, params_P: jax.Array, positions_Q: jax.Array, values_Q: None, origin: jax.Array
    ) -> jax.Array:
        return (positions_Q.astype(jnp.float32) - origin) * -_slope(params_P)

    def col(
        self,
        params_P: jax.Array,
        positions_K: jax.Array,
        values_K: None,
        origin: jax.Array,
        unit: float,
    ) -> jax.Array:
        return (positions_K.astype(jnp.float32) - origin) * (_slope(params_P) * unit)

    def __call__(self, params_P: jax.Array, tile: TermTile) -> jax.Array:
        q_BT, k_BS = batch_rows(tile)
        slopes_P = jax.lax.stop_gradient(params_P)
        return alibi_bias(q_BT, k_BS, slopes_P).reshape(tile_shape(tile))


def _slope(params_P: jax.Array) -> jax.Array:
    return param_scalars(jax.lax.stop_gradient(params_P))[0]


def _slope(params_P: jax.Array) -> jax.Array:
    return param_scalars(jax.lax.stop_gradient(params_P))[0]
