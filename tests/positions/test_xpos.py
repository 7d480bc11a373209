"""xPos (Sun et al. 2022, arXiv 2212.10554) against a NumPy reference from the paper's equations.

Reference: RoFormer's W_m (rotate-half feature order) and, for pair i,
zeta_i = (2i/d + gamma) / (1 + gamma), q_n scaled by zeta^(n / scale_base), k_m by
zeta^(-m / scale_base), with uncentred positions: the implementation's centring must cancel.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from copejax.positions import registry
from copejax.positions.base import AttentionContext, Dims
from copejax.positions.rope import apply_rope
from copejax.positions.xpos import apply_xpos
from tests.conftest import tiny_config
from tests.positions.test_rope import half_to_pairs, roformer_thetas, rotation_matrix


def reference_pair_scores(q: np.ndarray, k: np.ndarray, n: int, m: int, xpos: bool) -> np.ndarray:
    """Per-pair contributions to q_n . k_m (float64), rotate-half layout, gamma 0.4, 512."""
    d = q.shape[-1]
    thetas = roformer_thetas(d, 10000.0)
    order = half_to_pairs(d)
    q_rot = rotation_matrix(n, thetas) @ q[order].astype(np.float64)
    k_rot = rotation_matrix(m, thetas) @ k[order].astype(np.float64)
    if xpos:
        zeta = np.array([(2 * i / d + 0.4) / 1.4 for i in range(d // 2)])
        q_rot *= np.repeat(zeta ** (n / 512.0), 2)
        k_rot *= np.repeat(zeta ** (-m / 512.0), 2)
    return (q_rot * k_rot).reshape(d // 2, 2).sum(-1)


def site_scores(q: np.ndarray, k: np.ndarray, pos: np.ndarray, max_len: int = 16) -> np.ndarray:
    """Scores q_t . k_s (B, N, T, S) after the xpos site."""
    dims = Dims(
        d_model=16, num_heads=q.shape[2], head_dim=q.shape[3], num_layers=1, max_len=max_len
    )
    site = registry.make_scheme("xpos").attention_module(dims)
    ctx = AttentionContext(
        x_BTD=jnp.zeros((*pos.shape, 16)),
        q_positions_BT=jnp.asarray(pos),
        k_positions_BS=jnp.asarray(pos),
        explicit_mask_BTS=jnp.ones((*pos.shape, pos.shape[1]), bool),
    )
    q_out, k_out, _ = site.apply(
        {}, jnp.asarray(q), jnp.asarray(k), jnp.asarray(k), ctx, method=lambda s, *a: s.qk(*a)
    )
    return np.einsum("btnh,bsnh->bnts", np.asarray(q_out, np.float64), np.asarray(k_out))


def test_scores_match_the_reference(rng: np.random.Generator) -> None:
    q = rng.normal(size=(2, 5, 2, 8)).astype(np.float32)
    k = rng.normal(size=(2, 5, 2, 8)).astype(np.float32)
    pos = rng.integers(0, 100, (2, 5))
    got = site_scores(q, k, pos)
    for b, h, t, s in np.ndindex(got.shape):
        want = reference_pair_scores(q[b, t, h], k[b, s, h], pos[b, t], pos[b, s], True).sum()
        np.testing.assert_allclose(got[b, h, t, s], want, rtol=1e-4, atol=1e-4)


def test_each_pair_decays_by_exactly_zeta_to_the_distance(rng: np.random.Generator) -> None:
    """Pair i of xPos's q_n . k_m is RoPE's pair i times zeta_i^((n - m) / scale_base)."""
    d = 8
    q, k = rng.normal(size=(2, d)).astype(np.float32)
    zeta = np.array([(2 * i / d + 0.4) / 1.4 for i in range(d // 2)])
    for n, m in [(300, 10), (1000, 999), (2000, 0), (5, 5)]:
        qx, kx = apply_xpos(
            jnp.asarray(q)[None, None, None],
            jnp.asarray(k)[None, None, None],
            jnp.asarray([[n]]),
            jnp.asarray([[m]]),
            center=700.0,
        )
        inv_freq = jnp.asarray(roformer_thetas(d, 10000.0), jnp.float32)
        qr = apply_rope(jnp.asarray(q)[None, None, None], jnp.asarray([[n]]), inv_freq)
        kr = apply_rope(jnp.asarray(k)[None, None, None], jnp.asarray([[m]]), inv_freq)
        pairs_x = np.asarray(qx * kx, np.float64).reshape(2, d // 2).sum(0)
        pairs_r = np.asarray(qr * kr, np.float64).reshape(2, d // 2).sum(0)
        np.testing.assert_allclose(pairs_x, pairs_r * zeta ** ((n - m) / 512.0), rtol=2e-4)
        np.testing.assert_allclose(pairs_r, reference_pair_scores(q, k, n, m, False), atol=2e-4)


def test_scores_are_invariant_to_shifting_all_positions(rng: np.random.Generator) -> None:
    q = rng.normal(size=(1, 6, 2, 8)).astype(np.float32)
    k = rng.normal(size=(1, 6, 2, 8)).astype(np.float32)
    pos = np.sort(rng.integers(0, 40, (1, 6)), axis=1)
    base = site_scores(q, k, pos)
    for shift in (13, 900):
        np.testing.assert_allclose(site_scores(q, k, pos + shift), base, rtol=1e-4, atol=1e-4)


def test_large_positions_stay_finite_and_accurate(rng: np.random.Generator) -> None:
    """Positions around 6000 with the default centre (max_len // 2) at max_len = 4096."""
    q = rng.normal(size=(1, 4, 1, 8)).astype(np.float32)
    k = rng.normal(size=(1, 4, 1, 8)).astype(np.float32)
    pos = np.array([[5000, 6000, 7000, 8191]])
    got = site_scores(q, k, pos, max_len=4096)
    assert np.all(np.isfinite(got))
    for t, s in np.ndindex(4, 4):
        want = reference_pair_scores(q[0, t, 0], k[0, s, 0], pos[0, t], pos[0, s], True).sum()
        np.testing.assert_allclose(got[0, 0, t, s], want, rtol=2e-3, atol=2e-3)


def test_odd_head_dim_is_rejected() -> None:
    with pytest.raises(ValueError, match="head_dim must be even"):
        tiny_config("xpos", head_dim=7)


@pytest.mark.parametrize(
    ("options", "match"),
    [({"gamma": 0.0}, "gamma"), ({"scale_base": -1.0}, "scale_base"), ({"layout": "x"}, "layout")],
)
def test_bad_options_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("xpos", position_options=options)


def test_centring_prevents_overflow_far_from_zero(rng: np.random.Generator) -> None:
    """At positions ~40000, zeta_0^(-m/512) overflows float32 unless positions are centred."""
    q, k = rng.normal(size=(2, 1, 2, 1, 8)).astype(np.float32)
    n, m = 40010, 40000
    positions = (jnp.asarray([[n, m]]), jnp.asarray([[n, m]]))
    raw_q, raw_k = apply_xpos(jnp.asarray(q), jnp.asarray(k), *positions, center=0.0)
    assert not np.all(np.isfinite(np.asarray(raw_q * raw_k)))
    cq, ck = apply_xpos(jnp.asarray(q), jnp.asarray(k), *positions, center=40000.0)
    score = float(jnp.sum(cq[0, 0, 0] * ck[0, 1, 0]))
    d = 8
    zeta = np.array([(2 * i / d + 0.4) / 1.4 for i in range(d // 2)])
    rope_pairs = reference_pair_scores(q[0, 0, 0], k[0, 1, 0], n, m, False)
    np.testing.assert_allclose(score, (rope_pairs * zeta ** ((n - m) / 512)).sum(), atol=5e-3)
