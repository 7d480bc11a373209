"""The carries per (key tile, query) of the TPU kernels, stored as lane-dense rows (issue 45).

Stick-breaking's dq kernel writes the log stick remainder ``r`` and the ``G`` total ``u``
entering each key tile (:mod:`copejax.ops.kernels.tpu_stick`); CoPE's forward writes the count
entering each key tile and its dq kernel the count's cotangent leaving it
(:mod:`copejax.ops.kernels.tpu_cope`); the dk / dv kernel reads them back for its pairs. In a
kernel a carry is a (Q, 1) column, one float32 per query row. Stored as (B, N, count_k, T, 1),
as they were, TPU's HBM tiles the last two axes by (8, 128): each float32 took a 128-lane row,
512 bytes, and at (B, N, H) = (2, 4, 64), T = 16384 stick-breaking's two carries took 16 GiB,
more than a v5e's HBM (``experiments/results/kernel_tpu.md``). Here they are
(B, N, count_k, count_q, 1, Q): each query tile's carries one row, its queries along the lanes
(4 bytes each from Q = 128 up; a query tile under the lane width pads its row to 128 lanes),
read and written as whole (1, Q) blocks, which Mosaic takes at any Q (a (1, Q) block of a
(.., 1, T) array would need Q % 128 == 0). The kernels turn a row into a column and back
through a (Q, Q) diagonal mask and a sum, once per grid step: Mosaic's reshape between them is
a sublane gather, which v4 does not have (``experiments.kernel_tpu`` compiles both on v4, v5e,
v5p and v6e). Shape letters as in :mod:`copejax.ops.kernels.tpu_forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.tiles import Plan


def carry_shape(plan: Plan, batch: int, heads: int) -> jax.ShapeDtypeStruct:
    """One float32 carry per (key tile, query) of each head: (B, N, count_k, count_q, 1, Q)."""
    shape = (batch, heads, plan.count_k, plan.count_q, 1, plan.size_q)
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def carry_spec(plan: Plan, tiles: Callable) -> pl.BlockSpec:
    """The (1, Q) block of a grid step (b, n, outer, walked): ``tiles(outer, walked)`` gives
    its (key tile, query tile)."""

    def index(b: jax.Array, n: jax.Array, outer: jax.Array, walked: jax.Array) -> tuple:
        key_tile, query_tile = tiles(outer, walked)
        return (b, n, key_tile, query_tile, 0, 0)

    return pl.BlockSpec((None, None, None, None, 1, plan.size_q), index)


def store_carry(ref: object, column_Q1: jax.Array) -> None:
    """Writes a (Q, 1) carry into its (1, Q) block: the column broadcast along the lanes,
    its diagonal kept and summed down the sublanes (exact: the other terms are zeros).
    Mosaic's shape cast of (Q, 1) to (1, Q) is a sublane gather, which v4 lacks."""
    diagonal_QQ = jnp.where(_diagonal(column_Q1.shape[0]), column_Q1, 0.0)
    ref[...] = jnp.sum(diagonal_QQ, axis=0, keepdims=True)


def load_carry(ref: object) -> jax.Array:
    """The (Q, 1) carry of a (1, Q) block: the row broadcast down the sublanes, its diagonal
    summed along the lanes."""
    row_1Q = ref[...]
    return jnp.sum(jnp.where(_diagonal(row_1Q.shape[1]), row_1Q, 0.0), axis=1, keepdims=True)


def _diagonal(size: int) -> jax.Array:
    """(Q, Q) booleans, true on the diagonal."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    return rows == jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
