"""FIRE (Li et al. 2023, arXiv 2310.04418) as written in TAPE (seed 004) section 2.2."""

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
from copejax.positions.fire import fire_bias
from tests.conftest import tiny_config

B, T, N, W = 2, 6, 3, 5


def reference_bias(pos, mask, c, big_l, mlp):
    """b(i, j) = f(psi(i - j) / psi(max(i, L))), psi(x) = log(c x + 1), f = ReLU MLP."""
    w1, b1, w2, b2 = mlp
    out = np.zeros((B, N, T, T))
    for b in range(B):
        for i in range(T):
            for j in range(T):
                if not mask[b, i, j]:
                    continue
                qi, kj = float(pos[b, i]), float(pos[b, j])
                x = math.log(c * abs(qi - kj) + 1) / (math.log(c * max(qi, big_l) + 1) + 1e-6)
                hidden = np.maximum(x * w1[0] + b1, 0.0)
                out[b, :, i, j] = hidden @ w2 + b2
    return out


def random_mlp(rng: np.random.Generator):
    return tuple(
        rng.normal(size=shape).astype(np.float32) for shape in [(1, W), (W,), (W, N), (N,)]
    )


@pytest.mark.parametrize("max_pos", [10, 100])  # i below L = 16, and i beyond it
def test_site_bias_matches_reference(max_pos: int) -> None:
    rng = np.random.default_rng(max_pos)
    pos = np.sort(rng.integers(0, max_pos, (B, T)), axis=1)
    mask = np.tril(np.ones((T, T), bool))[None] & (rng.random((B, T, T)) < 0.9)
    mlp = random_mlp(rng)
    dims = Dims(d_model=12, num_heads=N, head_dim=4, num_layers=1, max_len=16)
    site = registry.make_scheme("fire", {"mlp_width": W}).attention_module(dims)
    q = jnp.zeros((B, T, N, 4))
    logits = jnp.zeros((B, N, T, T))
    ctx = AttentionContext(
        x_BTD=jnp.zeros((B, T, 12)),
        q_positions_BT=jnp.asarray(pos),
        k_positions_BS=jnp.asarray(pos),
        explicit_mask_BTS=jnp.asarray(mask),
    )
    params = flax.core.unfreeze(site.init(jax.random.key(0), q, q, q, logits, ctx, method="bias"))
    names = ("mlp_in_kernel", "mlp_in_bias", "mlp_out_kernel", "mlp_out_bias")
    values = dict(zip(names, mlp, strict=True), c=np.float32(-0.3), threshold_scale=np.float32(0.5))
    for name, value in values.items():
        params["params"][name] = params["params"][name].replace_boxed(jnp.asarray(value))
    got = np.asarray(site.apply(params, q, q, q, logits, ctx, method="bias"))
    # c = |c_raw| = 0.3 and L = |0.5| * max_len = 8.
    want = reference_bias(pos, mask, 0.3, 8.0, mlp)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_translation_invariant_only_below_the_threshold() -> None:
    rng = np.random.default_rng(1)
    w1, b1, w2, b2 = random_mlp(rng)
    params = {
        "c": jnp.float32(0.7),
        "threshold": jnp.float32(64.0),
        "w1_1F": w1,
        "b1_F": b1,
        "w2_FN": w2,
        "b2_N": b2,
    }
    pos = jnp.asarray(np.sort(rng.integers(0, 20, (B, T)), axis=1))
    base = fire_bias(pos, pos, params)
    np.testing.assert_allclose(fire_bias(pos + 40, pos + 40, params), base, atol=1e-6)
    beyond = fire_bias(pos + 200, pos + 200, params)  # max(i, L) = i: the normaliser moves
    assert np.abs(np.asarray(beyond - base)).max() > 1e-3


def test_model_is_translation_invariant_below_the_threshold() -> None:
    model = Transformer(tiny_config("fire", num_layers=1))  # L = max_len = 16
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 13, (2, 8)))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    params = model.init(jax.random.key(0), tokens, positions)
    np.testing.assert_allclose(
        model.apply(params, tokens, positions + 7),
        model.apply(params, tokens, positions),
        atol=1e-5,
    )


@pytest.mark.parametrize(
    ("options", "match"),
    [({"mlp_width": 0}, "mlp_width"), ({"c_init": -1.0}, "c_init"), ({"threshold_init": 0}, "thr")],
)
def test_bad_options_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("fire", position_options=options)
