"""Linear interpolation of integer-indexed tables at fractional positions (CoPE eq. 8).

Golovneva et al. 2024, arXiv 2405.18719: a query's scores z_i[p] = q_i . e[p] are computed for
integer p only, then read at a fractional position p_ij by
``z_i[p_ij] = (p_ij - floor p_ij) z_i[ceil p_ij] + (1 - p_ij + floor p_ij) z_i[floor p_ij]``,
so that the vectors e[p_ij] are never materialised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def interpolate_last_axis(table_XP: jax.Array, positions_XS: jax.Array) -> jax.Array:
    """Reads ``table_XP`` along its last axis at the fractional ``positions_XS``.

    Args:
      table_XP: values at integer positions 0..P-1 along the last axis (any leading shape X,
        e.g. z_BNTP).
      positions_XS: fractional positions in [0, P - 1], same leading shape X, any last-axis
        length S (e.g. p_BNTS).

    Returns:
      float32 array of shape X + (S,). At an integer position the result is the table value
      itself (floor == ceil). Gradients flow to the table and to the positions (through the
      weight ``p - floor p``); floor and ceil themselves have zero gradient.
    """
    table_XP = table_XP.astype(jnp.float32)
    positions_XS = positions_XS.astype(jnp.float32)
    floor_XS = jnp.floor(positions_XS)
    ceil_XS = jnp.ceil(positions_XS)
    weight_XS = positions_XS - floor_XS
    at_floor_XS = jnp.take_along_axis(table_XP, floor_XS.astype(jnp.int32), axis=-1)
    at_ceil_XS = jnp.take_along_axis(table_XP, ceil_XS.astype(jnp.int32), axis=-1)
    return weight_XS * at_ceil_XS + (1.0 - weight_XS) * at_floor_XS
