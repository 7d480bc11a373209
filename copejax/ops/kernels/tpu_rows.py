"""Per-query float32 values of the TPU kernels stored as lane-dense rows (issue 45): the
log-sum-exp and D = rowsum(dO o O), the terms' per-query values (FoX's prefix sums) and their
gradients, CoPE's row totals, and stick-breaking's and CoPE's carries for the head's queries in
VMEM.

In a kernel such a value is a (Q, 1) column, one float32 per query row. Stored as a (.., T, 1)
array, TPU's HBM tiles the last two axes by (8, 128): each float32 takes a 128-lane row, 512
bytes. For the log-sum-exp and D, (B, N, T, 1) each, that was 1 GiB of the nope kernel's
3.6 GiB of temporaries at (B, N, H) = (4, 16, 128), T = 16384; stick-breaking's carries per key
tile, (B, N, count_k, T, 1), took 16 GiB at (2, 4, 64), more than a v5e's HBM
(``experiments/results/kernel_tpu.md``). Here they are (B, N, count_q, 1, Q): each query
tile's values one row, its queries along the lanes (4 bytes each from Q = 128 up; a query
tile under the lane width pads its row to 128 lanes), read and written as whole (1, Q)
blocks, which Mosaic takes at any Q (a (1, Q) block of a (.., 1, T) array would need Q % 128
== 0); in VMEM, (count_q, Q) with a dynamic row. The kernels turn a row into a column and back
through a (Q, Q) diagonal mask and a sum, once per grid step and value: Mosaic's reshape
between them is a sublane gather, which v4 does not have (``experiments.kernel_tpu`` compiles
both on v4, v5e, v5p and v6e). Shape letters as in :mod:`copejax.ops.kernels.tpu_forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.tiles import Plan


def query_rows(plan: Plan, x_BNT: jax.Array) -> jax.Array:
    """(B, N, T) float32 per query -> (B, N, count_q, 1, Q), T = count_q Q."""
    batch, heads = x_BNT.shape[:2]
    return x_BNT.reshape(batch, heads, plan.count_q, 1, plan.size_q)


def from_query_rows(x_BNC1Q: jax.Array) -> jax.Array:
    """:func:`query_rows`' inverse."""
    batch, heads = x_BNC1Q.shape[:2]
    return x_BNC1Q.reshape(batch, heads, -1)


def rows_shape(plan: Plan, batch: int, heads: int) -> jax.ShapeDtypeStruct:
    """One float32 per query of each head: (B, N, count_q, 1, Q)."""
    return jax.ShapeDtypeStruct((batch, heads, plan.count_q, 1, plan.size_q), jnp.float32)


def row_spec(plan: Plan, q_tile: Callable) -> pl.BlockSpec:
    """The (1, Q) block of a grid step (b, n, outer, walked) of (B, N, count_q, 1, Q) rows:
    ``q_tile(outer, walked)`` gives its query tile."""
    return pl.BlockSpec(
        (None, None, None, 1, plan.size_q), lambda b, n, i, j: (b, n, q_tile(i, j), 0, 0)
    )


def store_row(ref: object, column_Q1: jax.Array) -> None:
    """Writes a (Q, 1) column into its (1, Q) block."""
    ref[...] = _row(column_Q1)


def as_row(column_Q1: jax.Array) -> jax.Array:
    """A (Q, 1) column as a (1, Q) row (for a write by DMA)."""
    return _row(column_Q1)


def load_row(ref: object) -> jax.Array:
    """The (Q, 1) column of a (1, Q) block."""
    return _column(ref[...])


def load_row_at(ref: object, index: jax.Array) -> jax.Array:
    """The (Q, 1) column of row ``index`` of a (rows, Q) VMEM ref."""
    return _column(ref[pl.ds(index, 1), :])


def add_row_at(ref: object, index: jax.Array, column_Q1: jax.Array) -> None:
    """Adds a (Q, 1) column to row ``index`` of a (rows, Q) VMEM ref."""
    ref[pl.ds(index, 1), :] += _row(column_Q1)


def read_rows(refs: list) -> list:
    """The (Q, 1) columns of (1, Q) row blocks (the terms' per-query values), None where a
    term has none."""
    return [None if r is None else load_row(r) for r in refs]


def _row(column_Q1: jax.Array) -> jax.Array:
    """(Q, 1) -> (1, Q): the column broadcast along the lanes, its diagonal kept and summed
    down the sublanes (exact: the other terms are zeros)."""
    diagonal_QQ = jnp.where(_diagonal(column_Q1.shape[0]), column_Q1, 0.0)
    return jnp.sum(diagonal_QQ, axis=0, keepdims=True)


def _column(row_1Q: jax.Array) -> jax.Array:
    """(1, Q) -> (Q, 1): the row broadcast down the sublanes, its diagonal summed along the
    lanes."""
    return jnp.sum(jnp.where(_diagonal(row_1Q.shape[1]), row_1Q, 0.0), axis=1, keepdims=True)


def _diagonal(size: int) -> jax.Array:
    """(Q, Q) booleans, true on the diagonal."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    return rows == jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
