"""FoX's kernel term (Lin et al. 2025, arXiv 2503.02130): ``c_i - c_j``, the prefix sums of
log forget gates, as a separable term of the fused kernels (issue 45,
:mod:`copejax.ops.kernels.separable`). The prefix sums are computed outside the kernels, and
their gradient, the row and minus the column sums of dS, leaves them for the reverse
cumulative sum that JAX takes around them.

Shape letters: Q / K the tile's queries / keys, X either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops.kernels.terms import TermTile, pair_grid


class FoxTile:
    """FoX's ``c_i - c_j`` (``fox_core.decay_BNTS``, one head's tile) as the row ``c_i - o``
    and the column ``o - c_j`` (:mod:`copejax.ops.kernels.separable`), ``o`` the largest
    prefix sum of one side of the tile: each side rounds at the tile's decays, not at the
    prefix sums' magnitude. Its pull-back: the row sums and minus the column sums of dS."""

    def origin(self, params_P: None, positions_X: jax.Array, values_X: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(jnp.max(values_X))

    def row(
        self, params_P: None, positions_Q: jax.Array, values_Q: jax.Array, origin: jax.Array
    ) -> jax.Array:
        return values_Q - origin

    def col(
        self,
        params_P: None,
        positions_K: jax.Array,
        values_K: jax.Array,
        origin: jax.Array,
        unit: float,
    ) -> jax.Array:
        col_K = origin - values_K
        return col_K if unit == 1.0 else col_K * unit

    def __call__(self, params_P: None, tile: TermTile) -> jax.Array:
        q_Q1, k_1K = pair_grid(tile.q_values_Q, tile.k_values_K)
        return q_Q1 - k_1K
