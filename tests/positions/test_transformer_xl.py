"""Transformer-XL relative attention (Dai et al. 2019, arXiv 1901.02860) against its score."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.positions.base import AttentionContext, Dims
from copejax.positions.transformer_xl import xl_bias, xl_inv_freq
from tests.conftest import tiny_config

B, T, N, H, R = 2, 6, 3, 4, 10


def reference_scores(q, k, q_pos, k_pos, mask, w_r, u, v, base=10000.0):  # noqa: PLR0917
    """A_ij = q.k + q.W_R r_{i-j} + u.k + v.W_R r_{i-j}, over sqrt(H), r = [sin, cos]."""
    freqs = base ** (-np.arange(0, R, 2) / R)
    out = np.zeros((B, N, T, k.shape[1]))
    for b in range(B):
        for h in range(N):
            for i in range(T):
                for j in range(k.shape[1]):
                    if not mask[b, i, j]:
                        continue
                    d = float(q_pos[b, i] - k_pos[b, j])
                    r = np.concatenate([np.sin(d * freqs), np.cos(d * freqs)])
                    wr = w_r[:, h, :].T @ r  # W_R r_{i-j}, shape (H,)
                    qi, kj = q[b, i, h], k[b, j, h]
                    out[b, h, i, j] = (qi @ kj + qi @ wr + u[h] @ kj + v[h] @ wr) / np.sqrt(H)
    return out


def random_case(seed: int, max_pos: int):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, N, H)).astype(np.float32)
    k = rng.normal(size=(B, T, N, H)).astype(np.float32)
    pos = np.sort(rng.integers(0, max_pos, (B, T)), axis=1)
    mask = np.tril(np.ones((T, T), bool))[None] & (rng.random((B, T, T)) < 0.9)
    params = {
        "w_r": rng.normal(size=(R, N, H)).astype(np.float32),
        "u": rng.normal(size=(N, H)).astype(np.float32),
        "v": rng.normal(size=(N, H)).astype(np.float32),
    }
    return q, k, pos, mask, params


def site_scores(q, k, pos, mask, values) -> np.ndarray:
    dims = Dims(d_model=12, num_heads=N, head_dim=H, num_layers=1, max_len=16)
    site = registry.make_scheme("transformer_xl", {"r_dim": R}).attention_module(dims)
    q, k = jnp.asarray(q), jnp.asarray(k)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(H)
    ctx = AttentionContext(
        x_BTD=jnp.zeros((B, T, 12)),
        q_positions_BT=jnp.asarray(pos),
        k_positions_BS=jnp.asarray(pos),
        explicit_mask_BTS=jnp.asarray(mask),
    )
    params = flax.core.unfreeze(site.init(jax.random.key(0), q, k, k, logits, ctx, method="bias"))
    for name, value in values.items():
        box = params["params"][name]
        assert box.value.shape == value.shape, name
        params["params"][name] = box.replace_boxed(jnp.asarray(value))
    bias = site.apply(params, q, k, k, logits, ctx, method="bias")
    return np.where(mask[:, None], np.asarray(logits + bias), 0.0)


@pytest.mark.parametrize("max_pos", [8, 200])
def test_scores_match_the_four_term_reference(max_pos: int) -> None:
    q, k, pos, mask, params = random_case(0, max_pos)
    got = site_scores(q, k, pos, mask, params)
    want = reference_scores(q, k, pos, pos, mask, params["w_r"], params["u"], params["v"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bias_is_translation_invariant() -> None:
    q, k, pos, _, params = random_case(1, 30)
    named = {"w_r_RNH": params["w_r"], "u_NH": params["u"], "v_NH": params["v"]}
    freqs = xl_inv_freq(R, 10000.0)
    base = xl_bias(q, k, pos, pos, named, inv_freq_F=freqs)
    shifted = xl_bias(q, k, pos + 113, pos + 113, named, inv_freq_F=freqs)
    np.testing.assert_allclose(shifted, base, atol=2e-4)


def test_model_is_translation_invariant() -> None:
    model = Transformer(tiny_config("transformer_xl", num_layers=1))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 13, (2, 8)))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    params = model.init(jax.random.key(0), tokens, positions)
    np.testing.assert_allclose(
        model.apply(params, tokens, positions + 50),
        model.apply(params, tokens, positions),
        atol=1e-5,
    )


@pytest.mark.parametrize(("options", "match"), [({"r_dim": 7}, "r_dim"), ({"base": 0.0}, "base")])
def test_bad_options_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("transformer_xl", position_options=options)
