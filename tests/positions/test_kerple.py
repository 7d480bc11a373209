"""KERPLE (Chi et al. 2022, arXiv 2205.09921): log and power kernels against loop references."""

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
from copejax.positions.kerple import kerple_bias
from tests.conftest import tiny_config

B, T, N = 2, 7, 3


def reference_bias(pos, mask, r1, r2, variant):
    out = np.zeros((B, N, T, T))
    for b in range(B):
        for h in range(N):
            for i in range(T):
                for j in range(T):
                    if mask[b, i, j]:
                        d = abs(int(pos[b, i]) - int(pos[b, j]))
                        if variant == "log":
                            out[b, h, i, j] = -r1[h] * math.log(1 + r2[h] * d)
                        else:
                            out[b, h, i, j] = -r1[h] * d ** r2[h]
    return out


def site_and_params(variant: str, raw1: np.ndarray, raw2: np.ndarray, pos, mask):
    dims = Dims(d_model=12, num_heads=N, head_dim=4, num_layers=1, max_len=16)
    site = registry.make_scheme("kerple", {"variant": variant}).attention_module(dims)
    q = jnp.zeros((B, T, N, 4))
    logits = jnp.zeros((B, N, T, T))
    ctx = AttentionContext(
        x_BTD=jnp.zeros((B, T, 12)),
        q_positions_BT=jnp.asarray(pos),
        k_positions_BS=jnp.asarray(pos),
        explicit_mask_BTS=jnp.asarray(mask),
    )
    params = flax.core.unfreeze(site.init(jax.random.key(0), q, q, q, logits, ctx, method="bias"))
    for name, raw in (("r1_raw", raw1), ("r2_raw", raw2)):
        params["params"][name] = params["params"][name].replace_boxed(jnp.asarray(raw))

    def bias(p: dict) -> jax.Array:
        return site.apply(p, q, q, q, logits, ctx, method="bias")

    return bias, params


@pytest.mark.parametrize("variant", ["log", "power"])
def test_bias_matches_reference_with_positive_r(variant: str) -> None:
    rng = np.random.default_rng(0)
    pos = np.sort(rng.integers(0, 40, (B, T)), axis=1)
    mask = np.tril(np.ones((T, T), bool))[None] & (rng.random((B, T, T)) < 0.9)
    raw1, raw2 = rng.normal(size=(2, N)).astype(np.float32)
    r1 = np.log1p(np.exp(raw1.astype(np.float64)))  # softplus
    if variant == "log":
        r2 = np.log1p(np.exp(raw2.astype(np.float64)))
    else:
        r2 = 2 / (1 + np.exp(-raw2.astype(np.float64)))  # in (0, 2)
    bias, params = site_and_params(variant, raw1, raw2, pos, mask)
    want = reference_bias(pos, mask, r1, r2, variant)
    np.testing.assert_allclose(np.asarray(bias(params)), want, rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda p: bias(p).sum())(params)
    for leaf in jax.tree_util.tree_leaves(grads):  # d^r2 at d = 0 must not give NaN
        assert np.all(np.isfinite(np.asarray(leaf)))


@pytest.mark.parametrize("variant", ["log", "power"])
def test_default_init_gives_the_requested_r(variant: str) -> None:
    scheme = registry.make_scheme("kerple", {"variant": variant, "r1_init": 0.3, "r2_init": 1.5})
    r1, r2 = scheme.positive(*map(jnp.asarray, scheme.raw_init()))
    np.testing.assert_allclose([r1, r2], [0.3, 1.5], rtol=1e-5)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_translation_invariance(variant: str) -> None:
    rng = np.random.default_rng(1)
    q_pos = jnp.asarray(rng.integers(0, 50, (B, 5)))
    k_pos = jnp.asarray(rng.integers(0, 50, (B, 9)))
    r1, r2 = jnp.asarray(rng.uniform(0.1, 2, (2, N)), jnp.float32)
    np.testing.assert_allclose(
        kerple_bias(q_pos + 64, k_pos + 64, r1, r2, variant),
        kerple_bias(q_pos, k_pos, r1, r2, variant),
        rtol=1e-6,
    )
    model = Transformer(tiny_config("kerple", num_layers=1, position_options={"variant": variant}))
    tokens = jnp.asarray(rng.integers(0, 13, (2, 8)))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    params = model.init(jax.random.key(0), tokens, positions)
    np.testing.assert_allclose(
        model.apply(params, tokens, positions + 99),
        model.apply(params, tokens, positions),
        atol=1e-5,
    )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"variant": "cubic"}, "variant"),
        ({"r1_init": 0.0}, "r1_init"),
        ({"r2_init": -1.0}, "r2_init"),
        ({"variant": "power", "r2_init": 2.0}, r"r2_init must be in \(0, 2\)"),
    ],
)
def test_bad_options_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("kerple", position_options=options)
