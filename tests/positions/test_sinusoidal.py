"""Sinusoidal position encoding (Vaswani et al. 2017, arXiv 1706.03762), add and concat."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.positions.base import Dims
from copejax.positions.sinusoidal import sinusoidal_encoding
from tests.conftest import tiny_config


def reference_pe(positions: np.ndarray, d: int, base: float = 10000.0) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d))."""
    out = np.zeros((*positions.shape, d), np.float64)
    for index in np.ndindex(positions.shape):
        pos = float(positions[index])
        for i in range(d // 2):
            out[(*index, 2 * i)] = math.sin(pos / base ** (2 * i / d))
            out[(*index, 2 * i + 1)] = math.cos(pos / base ** (2 * i / d))
    return out


@pytest.mark.parametrize(("d", "base"), [(8, 10000.0), (6, 100.0)])
def test_encoding_matches_the_formula(rng: np.random.Generator, d: int, base: float) -> None:
    positions = rng.integers(0, 300, (2, 5))
    got = sinusoidal_encoding(jnp.asarray(positions), d, base)
    assert got.dtype == jnp.float32 and got.shape == (2, 5, d)
    np.testing.assert_allclose(np.asarray(got), reference_pe(positions, d, base), atol=2e-5)


def test_add_mode_adds_the_encoding(rng: np.random.Generator) -> None:
    dims = Dims(d_model=8, num_heads=2, head_dim=4, num_layers=1, max_len=16)
    module = registry.make_scheme("sinusoidal").embed_module(dims)
    x = rng.normal(size=(2, 5, 8)).astype(np.float32)
    positions = rng.integers(0, 50, (2, 5))
    out = module.apply({}, jnp.asarray(x), jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(out.x_BTD), x + reference_pe(positions, 8), atol=2e-5)


def test_concat_mode_appends_pos_dim_features(rng: np.random.Generator) -> None:
    dims = Dims(d_model=10, num_heads=2, head_dim=5, num_layers=1, max_len=16)
    scheme = registry.make_scheme("sinusoidal", {"mode": "concat", "pos_dim": 4})
    assert scheme.token_dim(10) == 6
    x = rng.normal(size=(2, 3, 6)).astype(np.float32)
    positions = rng.integers(0, 50, (2, 3))
    out = scheme.embed_module(dims).apply({}, jnp.asarray(x), jnp.asarray(positions))
    expected = np.concatenate([x, reference_pe(positions, 4)], axis=-1)
    np.testing.assert_allclose(np.asarray(out.x_BTD), expected, atol=2e-5)


def test_concat_widths_in_the_model() -> None:
    cfg = tiny_config("sinusoidal", position_options={"mode": "concat", "pos_dim": 12})
    model = Transformer(cfg)
    tokens = jnp.asarray([[1, 2, 3, 4]])
    positions = jnp.arange(4)[None]
    params = model.init(jax.random.key(0), tokens, positions)
    assert params["params"]["token_embed"]["embedding"].unbox().shape == (13, 32 - 12)
    emb = model.apply(params, tokens, positions, True, method=Transformer.embed)
    assert emb.x_BTD.shape == (1, 4, 32)
    np.testing.assert_allclose(
        np.asarray(emb.x_BTD[0, :, 20:]), reference_pe(np.arange(4), 12), atol=2e-6
    )
    assert model.apply(params, tokens, positions).shape == (1, 4, 13)
    # The default concat width is D // 2.
    assert registry.make_scheme("sinusoidal", {"mode": "concat"}).token_dim(32) == 16


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"mode": "sum"}, "mode must be one of"),
        ({"pos_dim": 4}, "pos_dim=4 applies only to mode='concat'"),
        ({"mode": "concat", "pos_dim": 3}, "pos_dim must be an even integer"),
        ({"mode": "concat", "pos_dim": 32}, "pos_dim must be an even integer"),
        ({"mode": "concat", "pos_dim": 0}, "pos_dim must be an even integer"),
        ({"base": -1.0}, "base must be > 0"),
    ],
)
def test_bad_options_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("sinusoidal", position_options=options)
