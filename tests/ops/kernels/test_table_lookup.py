"""``terms.table_lookup`` and its pull-back by hand (T5's table in the kernels): the value is
``table[index]``, and the gradient is ``d table[p] = sum_{index = p} g``, on tiles whose pairs
read one row (most T5 tiles: past max_distance) and tiles that read several."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.kernel_t5 import T5Tile
from copejax.ops.kernels.terms import TermTile, pulled_by_hand, table_lookup, table_lookup_pull
from copejax.positions.t5 import t5_bucket

ROWS = 8


def _index(uniform: bool) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.full((4, 6), 5) if uniform else rng.integers(0, ROWS, (4, 6))


@pytest.mark.parametrize("uniform", [True, False])
def test_value_and_gradients_are_the_tables(uniform: bool) -> None:
    rng = np.random.default_rng(1)
    index = _index(uniform)
    table = jnp.asarray(rng.normal(size=ROWS), jnp.float32)
    g = rng.normal(size=index.shape)
    np.testing.assert_array_equal(table_lookup(jnp.asarray(index), table), np.asarray(table)[index])
    want = np.zeros(ROWS)
    np.add.at(want, index, g)
    pulled = jax.vjp(lambda t: table_lookup(jnp.asarray(index), t), table)[1](jnp.asarray(g))[0]
    np.testing.assert_allclose(pulled, want, rtol=1e-6, atol=1e-6)
    by_hand = table_lookup_pull(jnp.asarray(index), table, jnp.asarray(g, jnp.float32))
    np.testing.assert_allclose(by_hand, want, rtol=1e-6, atol=1e-6)


def test_t5_tile_pulls_its_table_as_autodiff_does() -> None:
    """Near the diagonal (many buckets) and far from it (only the last)."""
    tile_fn = T5Tile(bidirectional=False, buckets=8, max_distance=16)
    assert pulled_by_hand(tile_fn)
    rng = np.random.default_rng(2)
    table = jnp.asarray(rng.normal(size=8), jnp.float32)
    g = jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)
    for q_first, k_first in [(16, 0), (160, 0)]:
        q = jnp.arange(q_first, q_first + 16, dtype=jnp.int32)
        k = jnp.arange(k_first, k_first + 16, dtype=jnp.int32)
        tile = TermTile(q, k, None, None)
        want = jax.vjp(lambda t, tile=tile: tile_fn(t, tile), table)[1](g)[0]
        np.testing.assert_allclose(tile_fn.pull_params(table, tile, g), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_tile_equals_the_table_read_at_every_pairs_bucket(bidirectional: bool) -> None:
    """The one-bucket test reads only the positions' extremes: it must take the one-row path
    exactly where every pair shares a bucket, and bound every pair's bucket elsewhere (the
    rows the lookup loops over), whatever the positions (packed documents restart them;
    keys after the queries; both signs of j - i bidirectionally)."""
    tile_fn = T5Tile(bidirectional=bidirectional, buckets=8, max_distance=16)
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.normal(size=8), jnp.float32)
    g = jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)
    restart = np.concatenate([np.arange(40, 48), np.arange(8)])  # a document boundary
    cases = [(16, 0), (160, 0), (0, 160), (0, 8), (40, 60), (100, 96)]
    tiles = [(np.arange(q, q + 16), np.arange(k, k + 16)) for q, k in cases]
    tiles.append((restart, np.arange(200, 216)))
    tiles.append((np.arange(300, 316), restart))
    for q, k in tiles:
        tile = TermTile(jnp.asarray(q, jnp.int32), jnp.asarray(k, jnp.int32), None, None)
        bucket_QK = np.asarray(t5_bucket(k[None, :] - q[:, None], bidirectional, 8, 16))
        np.testing.assert_array_equal(tile_fn(table, tile), np.asarray(table)[bucket_QK])
        want = np.zeros(8)
        np.add.at(want, bucket_QK, np.asarray(g))
        pulled = tile_fn.pull_params(table, tile, g)
        np.testing.assert_allclose(pulled, want, rtol=1e-5, atol=1e-5)
        low, high = tile_fn.bounds(*tile_fn.positions(tile))
        assert (low == high) == (bucket_QK.min() == bucket_QK.max())
        # the rows the other tiles loop over: every pair's bucket among them
        assert low <= bucket_QK.min() and bucket_QK.max() <= high, (q[0], k[0])
