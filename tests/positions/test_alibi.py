"""ALiBi (Press et al. 2022, arXiv 2108.12409) against the paper's equations and slopes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.positions.alibi import alibi_bias, alibi_slopes
from copejax.positions.base import AttentionContext, Dims
from tests.conftest import tiny_config


def authors_get_slopes(n: int) -> list[float]:
    """The recursive ``get_slopes`` of the ALiBi authors' code, written out again."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + authors_get_slopes(2 * closest)[0::2][: n - closest]


def test_slopes_for_eight_heads_are_halves_down_to_1_over_256() -> None:
    np.testing.assert_allclose(alibi_slopes(8), [2.0**-k for k in range(1, 9)], rtol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 12, 16, 20, 24, 48])
def test_slopes_match_the_authors_recursive_formula(n: int) -> None:
    np.testing.assert_allclose(alibi_slopes(n), authors_get_slopes(n), rtol=1e-12)


@pytest.mark.parametrize("bad", [0, -3, 2.0])
def test_bad_head_count_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(bad)  # type: ignore[arg-type]


def reference_bias(q_pos: np.ndarray, k_pos: np.ndarray, mask: np.ndarray, m: list[float]):
    batch, length = q_pos.shape
    out = np.zeros((batch, len(m), length, k_pos.shape[1]), np.float32)
    for b in range(batch):
        for h, slope in enumerate(m):
            for i in range(length):
                for j in range(k_pos.shape[1]):
                    if mask[b, i, j]:
                        out[b, h, i, j] = -slope * (q_pos[b, i] - k_pos[b, j])
    return out


def site_bias(num_heads: int, q_pos: np.ndarray, k_pos: np.ndarray, mask: np.ndarray):
    dims = Dims(d_model=8 * num_heads, num_heads=num_heads, head_dim=8, num_layers=1, max_len=16)
    site = registry.make_scheme("alibi").attention_module(dims)
    batch, length = q_pos.shape
    q = jnp.zeros((batch, length, num_heads, 8))
    k = jnp.zeros((batch, k_pos.shape[1], num_heads, 8))
    ctx = AttentionContext(
        x_BTD=jnp.zeros((batch, length, dims.d_model)),
        q_positions_BT=jnp.asarray(q_pos),
        k_positions_BS=jnp.asarray(k_pos),
        explicit_mask_BTS=jnp.asarray(mask),
    )
    logits = jnp.zeros((batch, num_heads, length, k_pos.shape[1]))
    params = site.init(jax.random.key(0), q, k, k, logits, ctx, method="bias")
    return np.asarray(site.apply(params, q, k, k, logits, ctx, method="bias"))


@pytest.mark.parametrize("num_heads", [4, 6])
def test_site_bias_matches_reference_on_random_positions(num_heads: int) -> None:
    rng = np.random.default_rng(0)
    q_pos = np.sort(rng.integers(0, 100, (2, 7)), axis=1).astype(np.int32)
    mask = q_pos[:, :, None] >= q_pos[:, None, :]
    mask &= rng.random(mask.shape) < 0.8
    got = site_bias(num_heads, q_pos, q_pos, mask)
    want = reference_bias(q_pos, q_pos, mask, authors_get_slopes(num_heads))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bias_is_translation_invariant() -> None:
    rng = np.random.default_rng(1)
    q_pos = jnp.asarray(rng.integers(0, 50, (2, 6)))
    k_pos = jnp.asarray(rng.integers(0, 50, (2, 9)))
    slopes = alibi_slopes(6)
    np.testing.assert_allclose(
        alibi_bias(q_pos + 37, k_pos + 37, slopes), alibi_bias(q_pos, k_pos, slopes), atol=1e-6
    )


def test_model_logits_are_invariant_to_shifting_all_positions() -> None:
    model = Transformer(tiny_config("alibi", num_heads=4))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 13, (2, 8)))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    params = model.init(jax.random.key(0), tokens, positions)
    base = model.apply(params, tokens, positions)
    shifted = model.apply(params, tokens, positions + 1000)
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(base), atol=1e-5)
