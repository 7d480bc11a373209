"""T5 relative bias (Raffel et al. 2020, arXiv 1910.10683) against a NumPy reference."""

from __future__ import annotations

import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.positions.base import AttentionContext, Dims
from copejax.positions.t5 import t5_bias, t5_bucket
from tests.conftest import tiny_config


def reference_bucket(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket of one relative position ``key - query``, written from its description."""
    offset = 0
    if bidirectional:
        num_buckets //= 2
        if rel > 0:
            offset = num_buckets
        n = abs(rel)
    else:
        n = max(-rel, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return offset + n
    val = max_exact + int(
        math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return offset + min(val, num_buckets - 1)


@pytest.mark.parametrize(
    ("bidirectional", "num_buckets", "max_distance"),
    [(False, 32, 128), (True, 32, 128), (False, 16, 50), (True, 10, 20), (False, 2, 8)],
)
def test_buckets_match_reference_on_many_distances(
    bidirectional: bool, num_buckets: int, max_distance: int
) -> None:
    rel = np.arange(-600, 601)
    got = np.asarray(t5_bucket(jnp.asarray(rel), bidirectional, num_buckets, max_distance))
    want = [reference_bucket(int(r), bidirectional, num_buckets, max_distance) for r in rel]
    np.testing.assert_array_equal(got, want)
    assert got.min() >= 0 and got.max() == num_buckets - 1


def test_causal_buckets_known_values() -> None:
    # 16 exact distances, then 16 log buckets over [16, 128): 16 * 8^(b / 16) starts bucket
    # 16 + b, e.g. 32 -> 16 + floor(16 / 3) = 21, 100 -> 30, 113 -> 31; beyond 128 all share 31.
    rel = -np.array([0, 1, 15, 16, 32, 100, 113, 128, 10_000])
    got = np.asarray(t5_bucket(jnp.asarray(rel)))
    assert got.tolist() == [0, 1, 15, 16, 21, 30, 31, 31, 31]
    assert np.asarray(t5_bucket(jnp.asarray([1, 5]))).tolist() == [0, 0]  # future keys: bucket 0


def reference_bias(q_pos, k_pos, mask, table, *, bidirectional, max_distance):
    batch, length = q_pos.shape
    out = np.zeros((batch, table.shape[1], length, k_pos.shape[1]), np.float32)
    for b in range(batch):
        for i in range(length):
            for j in range(k_pos.shape[1]):
                if mask[b, i, j]:
                    rel = int(k_pos[b, j] - q_pos[b, i])
                    bucket = reference_bucket(rel, bidirectional, table.shape[0], max_distance)
                    out[b, :, i, j] = table[bucket]
    return out


@pytest.mark.parametrize("bidirectional", [False, True])
def test_site_bias_matches_reference(bidirectional: bool) -> None:
    options = {"num_buckets": 8, "max_distance": 20, "bidirectional": bidirectional}
    dims = Dims(d_model=24, num_heads=3, head_dim=8, num_layers=1, max_len=16)
    site = registry.make_scheme("t5", options).attention_module(dims)
    rng = np.random.default_rng(0)
    q_pos = np.sort(rng.integers(0, 60, (2, 9)), axis=1)
    mask = rng.random((2, 9, 9)) < 0.7
    q = jnp.zeros((2, 9, 3, 8))
    logits = jnp.zeros((2, 3, 9, 9))
    ctx = AttentionContext(
        x_BTD=jnp.zeros((2, 9, 24)),
        q_positions_BT=jnp.asarray(q_pos),
        k_positions_BS=jnp.asarray(q_pos),
        explicit_mask_BTS=jnp.asarray(mask),
    )
    params = site.init(jax.random.key(0), q, q, q, logits, ctx, method="bias")
    table = rng.normal(size=(8, 3)).astype(np.float32)
    params = flax.core.unfreeze(params)
    params["params"]["relative_bias"] = params["params"]["relative_bias"].replace_boxed(
        jnp.asarray(table)
    )
    got = np.asarray(site.apply(params, q, q, q, logits, ctx, method="bias"))
    want = reference_bias(q_pos, q_pos, mask, table, bidirectional=bidirectional, max_distance=20)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_bias_is_translation_invariant() -> None:
    rng = np.random.default_rng(1)
    q_pos = jnp.asarray(rng.integers(0, 300, (2, 6)))
    k_pos = jnp.asarray(rng.integers(0, 300, (2, 9)))
    table = jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)
    for bidirectional in (False, True):
        np.testing.assert_array_equal(
            t5_bias(q_pos + 123, k_pos + 123, table, bidirectional, 128),
            t5_bias(q_pos, k_pos, table, bidirectional, 128),
        )


def test_one_table_shared_by_every_layer_and_model_is_translation_invariant() -> None:
    model = Transformer(tiny_config("t5", num_layers=3))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 13, (2, 8)))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    params = model.init(jax.random.key(0), tokens, positions)
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params["params"]))
    tables = [path for path in flat if path[-1] == "relative_bias"]
    assert len(tables) == 1, tables
    base = model.apply(params, tokens, positions)
    np.testing.assert_allclose(model.apply(params, tokens, positions + 500), base, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_buckets": 0}, "num_buckets"),
        ({"num_buckets": 3, "bidirectional": True}, "num_buckets"),
        ({"max_distance": -1}, "max_distance"),
        ({"num_buckets": 32, "max_distance": 10}, "max_distance"),
    ],
)
def test_bad_options_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("t5", position_options=options)
