"""Linear interpolation of integer-indexed tables at fractional positions (CoPE eq. 8).

Golovneva et al. 2024, arXiv 2405.18719: a query's scores z_i[p] = q_i . e[p] are computed for
integer p only, then read at a fractional position p_ij by
``z_i[p_ij] = (p_ij - floor p_ij) z_i[ceil p_ij] + (1 - p_ij + floor p_ij) z_i[floor p_ij]``,
so that the vectors e[p_ij] are never materialised.

The two reads are gathers from the table flattened to one axis, at ``row * P + index``: XLA's
CPU backend differentiates such a gather into a flat scatter-add, which measured about 20x
faster than the batched scatter of ``jnp.take_along_axis``'s gradient (B x N x Q = 1024 rows of
P = 64, 128 positions each: 2 ms against 45 ms forward+backward on a 2-core CPU). Most CoPE
key blocks skip the interpolation (saturated positions), so CoPE's whole layer gained less:
3-7 % of its process CPU time at T = 1024, 7-10 % at T = 4096 (B x N = 8). The values and
gradients are the same sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def interpolate_last_axis(table_XP: jax.Array, positions_XS: jax.Array) -> jax.Array:
    """Reads ``table_XP`` along its last axis at the fractional ``positions_XS``.

    Args:
      table_XP: values at integer positions 0..P-1 along the last axis (any leading shape X,
        e.g. z_BNTP).
      positions_XS: fractional positions in [0, P - 1], leading shape X (or one that
        broadcasts with the table's), any last-axis length S (e.g. p_BNTS). Indices outside
        the table are clipped to it (its first or last value).

    Returns:
      float32 array of shape X + (S,). At an integer position the result is the table value
      itself (floor == ceil). Gradients flow to the table and to the positions (through the
      weight ``p - floor p``); floor and ceil themselves have zero gradient.
    """
    size = table_XP.shape[-1]
    table_R = table_XP.astype(jnp.float32).reshape(-1)
    positions_XS = positions_XS.astype(jnp.float32)
    floor_XS = jnp.floor(positions_XS)
    ceil_XS = jnp.ceil(positions_XS)
    weight_XS = positions_XS - floor_XS
    rows = table_R.shape[0] // size
    row_start_X1 = (jnp.arange(rows, dtype=jnp.int32) * size).reshape(*table_XP.shape[:-1], 1)

    def read(index_XS: jax.Array) -> jax.Array:
        flat_XS = row_start_X1 + jnp.clip(index_XS.astype(jnp.int32), 0, size - 1)
        return table_R.at[flat_XS].get(mode="promise_in_bounds")

    return weight_XS * read(ceil_XS) + (1.0 - weight_XS) * read(floor_XS)
