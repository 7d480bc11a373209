"""T5's bucketed relative bias as a fused-kernel term (Raffel et al. 2020, arXiv 1910.10683;
issue 45): ``table[bucket(j - i), h]`` for one head's tile, the table read by
:func:`copejax.ops.kernels.terms.indexed_lookup`.

Most tiles of a long sequence read one bucket: every pair past ``max_distance`` reads the
last. Such a tile is found from its positions' extremes, not from its (Q, K) buckets: the
bucket is monotone in ``d = j - i`` (within each sign, bidirectional), so if the tile's
smallest and largest distance, ``min k - max q`` and ``max k - min q``, share a bucket, every
pair between does (with both signs in the range the two buckets differ). Those tiles then
compute no bucket at all (on an H100, the (Q, K) min and max that found them before took
~400 shuffles per tile) and read the row once. The other tiles loop over the buckets between
the two (from 0 where a bidirectional tile holds both signs) instead of all of them: near the
diagonal of a causal sequence with 64-key tiles, 27, 31 and 6 of the default 32. Shape
letters: Q / K the tile's queries / keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from copejax.ops.kernels.terms import (
    TermTile,
    indexed_lookup,
    indexed_lookup_pull,
    pair_grid,
)
from copejax.positions.t5 import t5_bucket


@dataclasses.dataclass(frozen=True)
class T5Tile:
    """T5's tile function for one head (the scheme's bucket count; the kernels pad the
    table's rows, to a power of two on a GPU), with its table's pull-back by hand
    (:func:`~copejax.ops.kernels.terms.indexed_lookup_pull`): a hand-written ``cond`` skips
    the one-hot sum on the tiles that read one bucket."""

    bidirectional: bool
    buckets: int
    max_distance: int

    def bucket(self, distance: jax.Array) -> jax.Array:
        """``t5_bucket`` of float distances (exact small integers), as float32."""
        relative = distance.astype(jnp.int32)
        out = t5_bucket(relative, self.bidirectional, self.buckets, self.max_distance)
        return out.astype(jnp.float32)

    def buckets_QK(self, q_x: jax.Array, k_x: jax.Array) -> jax.Array:
        """Every pair's bucket, float32 (Q, K), from float positions."""
        q_Q1, k_1K = pair_grid(q_x, k_x)
        return self.bucket(k_1K - q_Q1)

    def bounds(self, q_x: jax.Array, k_x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(low, high): every pair of the tile reads a bucket in [low, high], and they are
        equal only when every pair reads that bucket. The buckets of the tile's extreme
        distances, except that bidirectional buckets of distances of both signs start at
        bucket(0) = 0 (the negative side's). Computed on (1, 1) arrays, not scalars (Mosaic
        lowers vector maths)."""
        q_low, q_high = jnp.min(q_x, keepdims=True), jnp.max(q_x, keepdims=True)
        k_low, k_high = jnp.min(k_x, keepdims=True), jnp.max(k_x, keepdims=True)
        nearest = k_low.reshape(1, 1) - q_high.reshape(1, 1)
        farthest = k_high.reshape(1, 1) - q_low.reshape(1, 1)
        first, last = self.bucket(nearest), self.bucket(farthest)
        low = jnp.minimum(first, last)
        if self.bidirectional:
            low = jnp.where((nearest < 0) & (farthest > 0), 0.0, low)
        return jnp.min(low), jnp.max(jnp.maximum(first, last))

    @staticmethod
    def positions(tile: TermTile) -> tuple[jax.Array, jax.Array]:
        # float positions: an integer input to the lookup's custom JVP would get a float0
        # tangent, which no Pallas backend lowers
        return tile.q_positions_Q.astype(jnp.float32), tile.k_positions_K.astype(jnp.float32)

    def __call__(self, table_P: jax.Array, tile: TermTile) -> jax.Array:
        return indexed_lookup(self.buckets_QK, self.bounds, self.positions(tile), table_P)

    def pull_params(self, table_P: jax.Array, tile: TermTile, g_QK: jax.Array) -> jax.Array:
        inputs = self.positions(tile)
        return indexed_lookup_pull(self.buckets_QK, self.bounds, inputs, table_P, g_QK)
