"""FIRE's bias as a fused-kernel term (Li et al. 2023, arXiv 2310.04418; issue 45):
``f(psi(|i - j|) / psi(max(i, L)))`` for one head's tile, with f the MLP
``b2 + sum_u w2[u] relu(x w1[u] + b1[u])`` evaluated in a loop over the F hidden units
(``lax.fori_loop``: one unit's (Q, K) tile live at a time).

Its parameters' pull-back is written by hand (:meth:`FireTile.pull_params`): each unit's
pre-activation is recomputed where its three sums are taken, so only x, the cotangent and
x's own cotangent stay live across the units; c and L are pulled back through
``fire_normalized_distance`` by autodiff (two scalars). Before, the kernels differentiated an
unrolled loop, which keeps every unit's (Q, K) residuals at once: on an H100 (deviceless,
``experiments/results/kernel_ptx.md``) the dk / dv kernel spilled 19.5 KB per thread at
F = 32 and 64 x 64 tiles, and its forward 608 bytes; now 0.4 KB and none.

Who calls the pull-back:
- the GPU kernels that pull back the terms' parameters (the softmax dk / dv programs, CoPE's
  dk / dv and selective attention's backward), directly
  (:func:`copejax.ops.kernels.pullbacks.terms_vjp`; :func:`~copejax.ops.kernels.terms.
  pulled_by_hand`);
- on a TPU (the (1, P) row of Mosaic's layout), ``jax.vjp`` of the tile anywhere, as its
  custom VJP: autodiff of the loop would stack each unit's residuals, a scan Mosaic does not
  lower;
- elsewhere (Triton's and XLA's layout) the tile is the plain loop, since Triton lowers no
  custom VJP call: XLA differentiates it as it is (PaTH's leaves), and a Triton kernel that
  took ``jax.vjp`` of the terms in their parameters without ``terms_vjp`` would fail to
  lower (a scan with stacked residuals) rather than spill (none does).

The parameter row per head is c, L, b2[h], w1 (F), b1 (F), w2[:, h] (F)
(:func:`copejax.model.kernel_terms._fire`). Shape letters: Q / K the tile's queries / keys, P
the row's entries, F hidden units.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from copejax.ops.kernels.terms import TermTile, batch_rows, tile_shape
from copejax.positions.fire import fire_normalized_distance

_C, _L, _B2 = 0, 1, 2  # the row's scalar entries; w1, b1, w2 follow, F each


@dataclasses.dataclass(frozen=True)
class FireTile:
    """FIRE's tile function for one head, and its parameters' pull-back.

    Attributes:
      width: F, the MLP's hidden units.
    """

    width: int

    def unit(self, row_P: jax.Array, rows_P: jax.Array, unit: jax.Array) -> tuple:
        """(w1[u], b1[u], w2[u]) of hidden unit ``unit`` (traced), as scalars."""
        first = _B2 + 1 + unit
        return tuple(_entry(row_P, rows_P, first + i * self.width) for i in range(3))

    def distance(self, c: jax.Array, threshold: jax.Array, tile: TermTile) -> jax.Array:
        """x (Q, K): ``psi(|i - j|) / psi(max(i, L))`` of the tile's pairs."""
        q_BT, k_BS = batch_rows(tile)
        return fire_normalized_distance(q_BT, k_BS, c, threshold).reshape(tile_shape(tile))

    def __call__(self, row_P: jax.Array, tile: TermTile) -> jax.Array:
        if row_P.ndim == 1:  # Triton's layout (and XLA's): the loop as it is
            return self.value(row_P, tile)
        # Mosaic TPU's (1, P) row. Float positions: integer inputs of a custom derivative get
        # float0 cotangents, which no Pallas backend lowers.
        q_x, k_x = (x.astype(jnp.float32) for x in (tile.q_positions_Q, tile.k_positions_K))
        return _fire_bias_vjp(self, row_P, q_x, k_x)

    def value(self, row_P: jax.Array, tile: TermTile) -> jax.Array:
        """The tile's bias (Q, K), float32."""
        rows_P = _rows(row_P)
        c, threshold, b2 = (_entry(row_P, rows_P, i) for i in (_C, _L, _B2))
        x_QK = self.distance(c, threshold, tile)

        def add_unit(unit: jax.Array, out_QK: jax.Array) -> jax.Array:
            w1, b1, w2 = self.unit(row_P, rows_P, unit)
            return out_QK + w2 * jax.nn.relu(x_QK * w1 + b1)

        zeros_QK = jnp.zeros(x_QK.shape, jnp.float32)
        return jax.lax.fori_loop(0, self.width, add_unit, zeros_QK + b2)

    def pull_params(self, row_P: jax.Array, tile: TermTile, g_QK: jax.Array) -> jax.Array:
        """The row's gradient from the tile's cotangent ``g_QK``, shaped as ``row_P``:
        ``d w2[u] = sum g relu(z_u)``, ``d b1[u] = sum g w2[u] [z_u > 0]``, ``d w1[u] = sum
        g w2[u] [z_u > 0] x``, ``d b2 = sum g``, with ``z_u = x w1[u] + b1[u]`` (relu's
        derivative at 0 is 0, as ``jax.nn.relu``'s), and c, L through x's cotangent."""
        rows_P = _rows(row_P)
        c, threshold = (_entry(row_P, rows_P, i) for i in (_C, _L))
        x_QK, pull_x = jax.vjp(lambda c, L: self.distance(c, L, tile), c, threshold)

        def pull_unit(unit: jax.Array, carry: tuple) -> tuple:
            dx_QK, d_P = carry
            w1, b1, w2 = self.unit(row_P, rows_P, unit)
            z_QK = x_QK * w1 + b1
            gz_QK = jnp.where(z_QK > 0, g_QK * w2, 0.0)
            sums = (jnp.sum(gz_QK * x_QK), jnp.sum(gz_QK), jnp.sum(g_QK * jax.nn.relu(z_QK)))
            for i, total in enumerate(sums):  # d w1[u], d b1[u], d w2[u]
                d_P = d_P + jnp.where(rows_P == _B2 + 1 + unit + i * self.width, total, 0.0)
            return dx_QK + gz_QK * w1, d_P

        zeros = (jnp.zeros(x_QK.shape, jnp.float32), jnp.zeros(row_P.shape, jnp.float32))
        dx_QK, d_P = jax.lax.fori_loop(0, self.width, pull_unit, zeros)
        d_c, d_threshold = pull_x(dx_QK)
        for entry, grad in ((_C, d_c), (_L, d_threshold), (_B2, jnp.sum(g_QK))):
            d_P = d_P + jnp.where(rows_P == entry, grad, 0.0)
        return d_P


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fire_bias_vjp(
    tile_fn: FireTile, row_P: jax.Array, q_x: jax.Array, k_x: jax.Array
) -> jax.Array:
    """:meth:`FireTile.value`, differentiated by :meth:`FireTile.pull_params` wherever a
    kernel takes ``jax.vjp`` of its terms (autodiff of the loop over units would keep each
    unit's residuals, and Mosaic TPU lowers no scan that stacks them)."""
    return tile_fn.value(row_P, TermTile(q_x, k_x, None, None))


def _fire_bias_forward(
    tile_fn: FireTile, row_P: jax.Array, q_x: jax.Array, k_x: jax.Array
) -> tuple:
    return _fire_bias_vjp(tile_fn, row_P, q_x, k_x), (row_P, q_x, k_x)


def _fire_bias_backward(tile_fn: FireTile, saved: tuple, g_QK: jax.Array) -> tuple:
    row_P, q_x, k_x = saved
    d_P = tile_fn.pull_params(row_P, TermTile(q_x, k_x, None, None), g_QK)
    return d_P, jnp.zeros_like(q_x), jnp.zeros_like(k_x)


_fire_bias_vjp.defvjp(_fire_bias_forward, _fire_bias_backward)


def _rows(row_P: jax.Array) -> jax.Array:
    """Each entry's index in the row (int32), shaped as ``row_P``: (P,) on a GPU, (1, P) on
    a TPU."""
    return jax.lax.broadcasted_iota(jnp.int32, row_P.shape, row_P.ndim - 1)


def _entry(row_P: jax.Array, rows_P: jax.Array, entry: jax.Array | int) -> jax.Array:
    """``row_P``'s entry ``entry`` as a scalar: a masked sum (Triton lowers no slice of a
    register tile, nor a dynamic index; :func:`copejax.ops.kernels.terms.param_scalars`)."""
    return jnp.sum(jnp.where(rows_P == entry, row_P, 0.0))
